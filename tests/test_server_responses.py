"""OpenAI's Responses API (/v1/responses) through the official openai client, on a tiny model: the
output equals the chat endpoint's greedy reply for the same conversation (which test_server.py
checks against HF transformers), streamed and not; instructions, max_output_tokens, text.format,
a forced function call's round trip, reasoning items, and refusals that name the field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from server_helpers import llama_for_tools, metric, model_copy, openai_client, serve_app
from thinking_model import OPEN_THINKING_TEMPLATE, build_thinking_model

MODEL = "tiny-llama"
MAX_TOKENS = 24
USER = [{"role": "user", "content": "Tell me a story."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def base_url(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = llama_for_tools(tiny_model_factory, tmp_path_factory.mktemp("responses"))
    with serve_app(build_app(LLMEngine(EngineConfig(model=str(model_dir))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def chat_reply(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_the_output_is_the_chat_endpoints_greedy_reply(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=MAX_TOKENS,
                                       temperature=0)
    expected = chat_reply(client, USER, max_tokens=MAX_TOKENS)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == MAX_TOKENS
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_render_as_the_chat_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me "},
                                            {"type": "input_text", "text": "a story."}]}])
    expected = chat_reply(client, [{"role": "system", "content": "Be brief."}, *USER], max_tokens=MAX_TOKENS)
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == MAX_TOKENS


def test_a_stream_sends_the_responses_events_with_the_same_text(client: openai.OpenAI, base_url: str) -> None:
    whole = client.responses.create(model=MODEL, input=USER, max_output_tokens=MAX_TOKENS, temperature=0)
    events = list(client.responses.create(model=MODEL, input=USER, max_output_tokens=MAX_TOKENS, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == MAX_TOKENS
    raw = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                       "stream": True}, trust_env=False, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.startswith("event: response.created\ndata: ")


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input=USER, max_output_tokens=100, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input=USER, max_output_tokens=100, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "reply", "schema": schema}}) as stream:
        final = stream.get_final_response()  # the client's helper reads up to response.completed
    assert final.output_text == response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_round_trips(client: openai.OpenAI, stream: bool) -> None:
    """tool_choice naming the function constrains the output to its parameters, so the call is valid
    whatever the random model writes; its output goes back as a function_call_output item."""
    kwargs: dict[str, Any] = {"model": MODEL, "max_output_tokens": 150, "temperature": 0, "tools": TOOLS,
                              "input": [{"role": "user", "content": "Weather in Paris?"}],
                              "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = [*kwargs["input"], *response.output, {"type": "function_call_output", "call_id": call.call_id,
                                                    "output": "21 C"}]
    answer = client.responses.create(**{**kwargs, "tool_choice": "none", "input": history})
    expected = chat_reply(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}],
        max_tokens=150, tools=CHAT_TOOLS, tool_choice="none")
    assert answer.output_text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_refusals_name_the_field(base_url: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "Hi", **body},
                          trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_a_thinking_models_reasoning_is_a_reasoning_item(tmp_path: Path) -> None:
    """The split is the chat endpoint's (test_server_reasoning.py checks it against HF); an earlier
    turn's reasoning item, sent back or stored, is left out of the prompt."""
    model_dir = model_copy(build_thinking_model(tmp_path / "qwen3"), tmp_path / "open",
                           chat_template=OPEN_THINKING_TEMPLATE)
    with serve_app(build_app(LLMEngine(EngineConfig(model=str(model_dir))), MODEL)) as url:
        client = openai_client(url)
        response = client.responses.create(model=MODEL, input=USER, max_output_tokens=MAX_TOKENS, temperature=0)
        expected = chat_reply(client, USER, max_tokens=MAX_TOKENS)
        events = list(client.responses.create(model=MODEL, input=USER, max_output_tokens=MAX_TOKENS, temperature=0,
                                              stream=True))
        history = [*USER, *response.output, {"role": "user", "content": "Go on."}]
        again = client.responses.create(model=MODEL, input=history, max_output_tokens=1, temperature=0)
        continued = client.responses.create(model=MODEL, input="Go on.", previous_response_id=response.id,
                                            max_output_tokens=1, temperature=0)
        message = expected.choices[0].message
        without = chat_reply(client, [*USER, {"role": "assistant", "content": message.content or ""},
                                      {"role": "user", "content": "Go on."}], max_tokens=1)
    assert message.reasoning_content, "the tiny thinker wrote no reasoning"
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [message.reasoning_content]
    assert response.output_text == (message.content or "")
    assert response.usage.output_tokens_details.reasoning_tokens == \
        expected.usage.completion_tokens_details.reasoning_tokens
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == message.reasoning_content
    assert again.usage.input_tokens == continued.usage.input_tokens == without.usage.prompt_tokens


def test_each_endpoint_is_counted_apart(base_url: str, client: openai.OpenAI) -> None:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as http:
        def count(endpoint: str, status: str) -> float:
            return metric(http, "roseinfer_endpoint_responses_total", endpoint=endpoint, status=status)

        before = {(e, s): count(e, s) for e in ("/v1/responses", "/v1/chat/completions") for s in ("2xx", "4xx")}
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        assert http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 0}).status_code == 400
        assert http.get("/health").status_code == 200 and http.get("/no/such/path").status_code == 404
        after = {key: count(*key) for key in before}
        assert after[("/v1/responses", "2xx")] == before[("/v1/responses", "2xx")] + 1
        assert after[("/v1/responses", "4xx")] == before[("/v1/responses", "4xx")] + 1
        assert after[("/v1/chat/completions", "2xx")] == before[("/v1/chat/completions", "2xx")]
        samples = http.get("/metrics").text
        assert 'endpoint="/health"' not in samples and 'endpoint="/no/such/path"' not in samples
