"""Tools on /v1/chat/completions: which parser a template gets, what tool_choice constrains, how tools
and an earlier turn's calls and results render (with a template that reads `tools` and with one that
does not), and the whole round trip through the official openai client, streamed and not.

The tiny model is random: with tool_choice required or named the constraint is what makes its
calls valid, so those are checked exactly; with auto only that the response is well formed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from roseinfer.cli import build_parser
from roseinfer.config import EngineConfig
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions, server_options
from roseinfer.server.protocol import APIError, ChatCompletionRequest
from roseinfer.server.tool_calls import NO_PARAMETERS, chat_inputs, pick_parser, plan_tools
from roseinfer.server.tool_parsers import HermesParser, JsonCallsParser, NamedCallParser
from roseinfer.tokenizer import Tokenizer
from server_helpers import llama_for_tools, model_copy, openai_client, serve_app, served

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 150

# Qwen2.5's way, cut down: tools listed in the system turn, calls and results in <tool_call> and
# <tool_response> blocks, arguments written with tojson (so they must arrive as a dict)
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, **fields})


# ---- the parser a template gets ------------------------------------------------------------------
def test_the_parser_follows_the_template_unless_the_flag_names_one() -> None:
    assert pick_parser(HERMES_TEMPLATE) == "hermes"
    assert pick_parser("{{ '<|python_tag|>' }}{% for m in messages %}{% if m.role == 'ipython' %}x{% endif %}"
                       "{% endfor %}") == "llama3_json"
    assert pick_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert pick_parser(None) == "hermes"
    assert pick_parser(HERMES_TEMPLATE, "llama3_json") == "llama3_json"


def test_the_flag_is_checked_and_reaches_the_server_options() -> None:
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert server_options(args).tool_call_parser == "llama3_json"
    assert server_options(build_parser().parse_args(["serve"])).tool_call_parser == "auto"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerOptions(tool_call_parser="mistral")


# ---- what tool_choice means ----------------------------------------------------------------------
def test_tool_choice_auto_is_free_output_parsed_and_none_shows_no_tools() -> None:
    auto = plan_tools(request(), "hermes", output_constrained=False)
    assert auto.constraint is None and isinstance(auto.parser(), HermesParser)
    assert [t["function"]["name"] for t in auto.shown] == ["get_weather", "get_time"]
    assert auto.parser().max_calls is None
    assert plan_tools(request(parallel_tool_calls=False), "hermes", False).parser().max_calls == 1
    assert isinstance(plan_tools(request(), "llama3_json", False).parser(), JsonCallsParser)
    none = plan_tools(request(tool_choice="none"), "hermes", False)
    assert (none.shown, none.constraint, none.parser) == (None, None, None)
    # with response_format the output follows it: no calls to look for
    assert plan_tools(request(), "hermes", output_constrained=True).parser is None


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    plan = plan_tools(request(tool_choice=NAMED), "hermes", False)
    assert plan.constraint.params.json == WEATHER_PARAMS and plan.constraint.field == "tools"
    assert isinstance(plan.parser(), NamedCallParser) and plan.parser().name == "get_weather"
    no_params = request(tools=[{"type": "function", "function": {"name": "ping"}}],
                        tool_choice={"type": "function", "function": {"name": "ping"}})
    assert plan_tools(no_params, "hermes", False).constraint.params.json == NO_PARAMETERS


def test_required_constrains_the_output_to_an_array_of_valid_calls() -> None:
    schema = plan_tools(request(tool_choice="required"), "hermes", False).constraint.params.json
    assert schema["minItems"] == 1 and "maxItems" not in schema
    good = [{"name": "get_time", "parameters": {"zone": "CET"}},
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "Oslo", "unit": "f"}}],
                [{"name": "get_time", "parameters": {"zone": "CET"}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(request(tool_choice="required", parallel_tool_calls=False), "hermes", False)
    assert single.constraint.params.json["maxItems"] == 1


def test_required_moves_the_functions_definitions_to_the_top() -> None:
    params = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}]
    schema = plan_tools(request(tools=tools, tool_choice="required"), "hermes", False).constraint.params.json
    assert "Place" in schema["$defs"]
    jsonschema.validate([{"name": "go", "parameters": {"where": {"city": "Oslo"}}}], schema)
    clash = [tools[0], {"type": "function", "function": {"name": "stay", "parameters": {
        **params, "$defs": {"Place": {"type": "string"}}}}}]
    with pytest.raises(APIError, match="differently"):
        plan_tools(request(tools=clash, tool_choice="required"), "hermes", False)


@pytest.mark.parametrize("fields,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "give one"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "same name"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(fields: dict, param: str, words: str) -> None:
    body = request(**fields)
    with pytest.raises(APIError) as caught:
        plan_tools(body, "hermes", output_constrained=body.response_format is not None)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


# ---- rendering -----------------------------------------------------------------------------------
@pytest.fixture
def tokenizer_with(tokenizer_dir: Path, tmp_path: Path):
    def make(template: str) -> Tokenizer:
        return Tokenizer(model_copy(tokenizer_dir, tmp_path / str(abs(hash(template))), chat_template=template))
    return make


def render(tokenizer: Tokenizer, reads_tools: bool, body: ChatCompletionRequest) -> str:
    messages, variables = chat_inputs(body.messages, plan_tools(body, "hermes", False).shown, "hermes", reads_tools)
    return tokenizer.render_chat_template(messages, **variables)


def test_a_template_that_reads_tools_renders_them_and_the_history_itself(tokenizer_with) -> None:
    text = render(tokenizer_with(HERMES_TEMPLATE), True, request(messages=HISTORY))
    assert "# Tools\n<tools>\n" + json.dumps(TOOLS[0]) in text
    # the arguments reached the template as a dict: tojson wrote them as an object, not a string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert "You can call these functions" not in text  # no generic prompt on top of the template's


def test_a_template_without_tools_gets_them_as_a_system_prompt(tokenizer_with) -> None:
    chatml = tokenizer_with("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = render(chatml, False, request(messages=[{"role": "system", "content": "Be brief."}, *HISTORY]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions (JSON schemas):\n<tools>\n"
                           + json.dumps(TOOLS[0]))
    assert text.count("<|im_start|>system") == 1 and "<tool_call>\n{\"name\": \"<function name>\"" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
            '\n</tool_call><|im_end|>') in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    body = request(messages=HISTORY)
    messages, _ = chat_inputs(body.messages, plan_tools(body, "llama3_json", False).shown, "llama3_json", False)
    llama = chatml.render_chat_template(messages)
    assert '{"name": "<function name>", "parameters": <its arguments as a JSON object>}' in llama
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in llama
    plain = render(chatml, False, request(messages=HISTORY, tool_choice="none"))
    assert plain.startswith("<|im_start|>user\nWeather in Paris?") and "<tools>" not in plain


# ---- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_model(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_for_tools(tiny_model_factory, tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def base_url(long_model: Path) -> Iterator[str]:
    with serve_app(build_app(served(EngineConfig(model=str(long_model))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def create(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as OpenAI's dicts, finish reason) of one choice, streamed or not."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0,
              **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [call.model_dump(exclude_none=True) for call in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.id:  # a call's first chunk: its id, type and name
                assert entry.index not in calls and entry.function.arguments == "" and entry.type == "function"
                calls[entry.index] = {"id": entry.id, "type": "function",
                                      "function": {"name": entry.function.name, "arguments": ""}}
            else:
                calls[entry.index]["function"]["arguments"] += entry.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_gives_one_valid_call(client: openai.OpenAI, stream: bool) -> None:
    content, calls, reason = create(client, stream, tool_choice=NAMED)
    assert content is None and len(calls) == 1 and reason == "stop"  # OpenAI's for a forced call
    assert_valid_calls(calls, {"get_weather"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_valid_calls(client: openai.OpenAI, stream: bool, parallel: bool) -> None:
    content, calls, reason = create(client, stream, tool_choice="required", parallel_tool_calls=parallel,
                                    temperature=1.0, seed=5)
    assert calls and reason in ("tool_calls", "length")
    assert_valid_calls(calls, set(SCHEMAS))
    if not parallel:
        assert len(calls) == 1 and reason == "tool_calls" and content is None


@pytest.mark.parametrize("stream", [False, True])
def test_auto_gives_a_well_formed_answer(client: openai.OpenAI, stream: bool) -> None:
    content, calls, reason = create(client, stream, tool_choice="auto", max_tokens=40)
    assert content is not None or calls
    assert reason == ("tool_calls" if calls else reason) and reason in ("stop", "length", "tool_calls")
    for call in calls:
        json.loads(call["function"]["arguments"])
    default = create(client, stream, max_tokens=40)  # auto is the default with tools
    assert (default[0], [c["function"] for c in default[1]], default[2]) == (content, [c["function"] for c in calls],
                                                                             reason)


def test_streamed_and_whole_calls_agree_and_n_choices_each_get_theirs(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
                  temperature=1.0, seed=11, n=2)
    whole = client.chat.completions.create(**kwargs)
    streamed: dict[int, dict[int, str]] = {0: {}, 1: {}}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for entry in choice.delta.tool_calls or []:
                args = streamed[choice.index]
                args[entry.index] = args.get(entry.index, "") + entry.function.arguments
    for choice in whole.choices:
        assert [c.function.arguments for c in choice.message.tool_calls] == list(streamed[choice.index].values())


def test_pydantic_function_tool_parses_its_arguments(client: openai.OpenAI) -> None:
    class GetWeather(BaseModel):
        city: str = Field(max_length=8)
        unit: str = Field(pattern="^[cf]$")

    tool = openai.pydantic_function_tool(GetWeather)
    resp = client.chat.completions.parse(model=MODEL, messages=MESSAGES, tools=[tool], max_tokens=MAX_TOKENS,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "GetWeather"}})
    args = resp.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(args, GetWeather) and args.unit in ("c", "f")


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_turn_carries_the_calls_and_their_results(client: openai.OpenAI, base_url: str, stream: bool) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=MAX_TOKENS, temperature=0)
    message = first.choices[0].message
    history = [*MESSAGES, message,
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 21}'}]
    content, calls, reason = create(client, stream, messages=history, max_tokens=8)
    assert content is not None or calls
    with httpx.Client(base_url=base_url, trust_env=False) as http:
        sent = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in history]
        ids = http.post("/tokenize", json={"messages": sent, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    call = message.tool_calls[0].function
    assert json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False) in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text and "<tools>" in text


def test_tool_choice_none_shows_no_tools_and_parses_nothing(client: openai.OpenAI) -> None:
    with_none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                               max_tokens=4, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert with_none.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_none.choices[0].message.content == without.choices[0].message.content


def test_a_template_that_reads_tools_is_given_them(long_model: Path, tmp_path: Path) -> None:
    model = model_copy(long_model, tmp_path / "hermes", chat_template=HERMES_TEMPLATE)
    with serve_app(build_app(served(EngineConfig(model=str(model))), MODEL)) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=120) as http:
        ids = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()["tokens"]
        assert "# Tools\n<tools>" in http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http)
        content, calls, reason = create(client, False, tool_choice=NAMED)
        assert reason == "stop"
        assert_valid_calls(calls, {"get_weather"})
