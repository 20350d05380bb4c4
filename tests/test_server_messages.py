"""Anthropic's Messages API (/v1/messages) through the official anthropic client, on a tiny model:
the reply equals the chat endpoint's greedy reply for the same conversation (which test_server.py
checks against HF transformers), streamed and not; the stop reasons, usage, a forced tool call's
round trip, x-api-key auth, and refusals in Anthropic's error shape."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx2
import httpx
import jsonschema
import openai
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from server_helpers import llama_for_tools, metric, model_copy, openai_client, serve_app, served
from step_gate import StepGate
from thinking_model import OPEN_THINKING_TEMPLATE, build_thinking_model

MODEL = "tiny-llama"
MAX_TOKENS = 24
USER = [{"role": "user", "content": "Tell me a story."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# the client no longer offers temperature; the server takes it, as Anthropic's API did
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]


def anthropic_client(base_url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0,
                               http_client=httpx2.Client(trust_env=False, timeout=120))


@pytest.fixture(scope="module")
def long_model(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_for_tools(tiny_model_factory, tmp_path_factory.mktemp("messages"))


@pytest.fixture(scope="module")
def base_url(long_model: Path) -> Iterator[str]:
    with serve_app(build_app(served(EngineConfig(model=str(long_model))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic_client(base_url)


@pytest.fixture(scope="module")
def chat(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def chat_reply(chat: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> openai.types.chat.ChatCompletion:
    return chat.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def streamed(client: anthropic.Anthropic, **kwargs: Any) -> tuple[list[Any], str]:
    """The raw events of a streamed message, and its text."""
    events = list(client.messages.create(model=MODEL, extra_body=GREEDY, stream=True, **kwargs))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    return events, text


def test_the_reply_is_the_chat_endpoints_greedy_reply(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY)
    expected = chat_reply(chat, USER, max_tokens=MAX_TOKENS)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens == MAX_TOKENS
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None


def test_a_system_prompt_and_content_blocks_render_as_the_chat_conversation(client: anthropic.Anthropic,
                                                                            chat: openai.OpenAI) -> None:
    message = client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                               {"type": "text", "text": "a story."}]}])
    expected = chat_reply(chat, [{"role": "system", "content": "Be brief."}, *USER], max_tokens=MAX_TOKENS)
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    plain = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY)
    assert plain.usage.input_tokens < message.usage.input_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    full = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), "the greedy reply has no text to stop at"
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY,
                                     stop_sequences=["never appears", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[:full.index(stop)]
    events, text = streamed(client, max_tokens=MAX_TOKENS, messages=USER, stop_sequences=[stop])
    assert text == full[:full.index(stop)]
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == stop


def test_streamed_events_come_in_anthropics_order_with_the_same_text(client: anthropic.Anthropic,
                                                                      base_url: str) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY)
    events, text = streamed(client, max_tokens=MAX_TOKENS, messages=USER)
    kinds = [e.type for e in events]  # the client drops ping events
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    body = {"model": MODEL, "max_tokens": 2, "messages": USER, "stream": True}
    raw = httpx.post(f"{base_url}/v1/messages", json=body, trust_env=False, timeout=60)
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == MAX_TOKENS
    assert text == whole.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_round_trips(client: anthropic.Anthropic, chat: openai.OpenAI, stream: bool) -> None:
    """tool_choice naming the tool constrains the output to its input schema, so the call is valid
    whatever the random model would write; its result goes back as a tool_result block."""
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 150, "extra_body": GREEDY, "tools": TOOLS,
                              "messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    history = [*kwargs["messages"], {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    answer = client.messages.create(**{**kwargs, "tool_choice": {"type": "none"}, "messages": history})
    expected = chat_reply(chat, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"}],
        max_tokens=150, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                                 "description": "Current weather in a city"}}],
        tool_choice="none")
    assert answer.content[0].text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens


def test_tool_choice_any_gives_valid_calls(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=150, extra_body=GREEDY, tools=TOOLS,
                                     messages=[{"role": "user", "content": "Weather?"}],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [call] = message.content
    assert call.type == "tool_use" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)


@pytest.mark.parametrize("body, words", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "unsupported field 'thinking'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' are not supported"),
    ({"system": [{"type": "document", "source": {}}]}, "'document' are not supported"),
    ({"max_tokens": None}, "max_tokens"),
    ({"model": "claude-sonnet-4-5"}, "does not exist"),
])
def test_refusals_name_what_is_refused_in_anthropics_shape(base_url: str, body: dict[str, Any], words: str) -> None:
    request = {"model": MODEL, "max_tokens": 4, "messages": USER, **body}
    response = httpx.post(f"{base_url}/v1/messages", json={k: v for k, v in request.items() if v is not None},
                          trust_env=False, timeout=60)
    error = response.json()
    assert response.status_code == (404 if "does not exist" in words else 400), error
    assert error["type"] == "error" and words in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if "does not exist" in words else "invalid_request_error")


def test_the_client_raises_its_own_error_types(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="content blocks of type 'image'"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_an_api_key_is_taken_as_x_api_key_or_bearer_and_requests_are_counted(long_model: Path) -> None:
    app = build_app(served(EngineConfig(model=str(long_model))), MODEL, ServerOptions(api_key="sesame"))
    with serve_app(app) as url:
        message = anthropic_client(url, "sesame").messages.create(model=MODEL, max_tokens=4, messages=USER)
        assert message.usage.output_tokens == 4
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_client(url, "wrong").messages.create(model=MODEL, max_tokens=4, messages=USER)
        body = {"model": MODEL, "max_tokens": 4, "messages": USER}
        bearer = httpx.post(f"{url}/v1/messages", json=body, headers={"Authorization": "Bearer sesame"},
                            trust_env=False, timeout=60)
        assert bearer.status_code == 200
        missing = httpx.post(f"{url}/v1/messages", json=body, trust_env=False, timeout=60)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        keyed = httpx.get(f"{url}/v1/models", headers={"x-api-key": "sesame"}, trust_env=False, timeout=60)
        assert keyed.status_code == 200
        with httpx.Client(base_url=url, trust_env=False) as http:
            assert metric(http, "roseinfer_requests_rejected_total", reason="unauthorized") == 2
            assert metric(http, "roseinfer_requests_total", finish_reason="length") == 2


def test_a_thinking_models_reasoning_is_a_thinking_block(tmp_path: Path) -> None:
    """The split is the chat endpoint's (test_server_reasoning.py checks it against HF); an earlier
    turn's thinking block sent back is left out of the prompt."""
    model_dir = model_copy(build_thinking_model(tmp_path / "qwen3"), tmp_path / "open",
                           chat_template=OPEN_THINKING_TEMPLATE)
    with serve_app(build_app(served(EngineConfig(model=str(model_dir))), MODEL)) as url:
        client = anthropic_client(url)
        message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body=GREEDY)
        expected = chat_reply(openai_client(url), USER, max_tokens=MAX_TOKENS).choices[0].message
        events, text = streamed(client, max_tokens=MAX_TOKENS, messages=USER)
        history = [*USER, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                   {"role": "user", "content": "Go on."}]
        again = client.messages.create(model=MODEL, max_tokens=1, messages=history, extra_body=GREEDY)
        without = chat_reply(openai_client(url), [*USER, {"role": "assistant", "content": expected.content or ""},
                                                  {"role": "user", "content": "Go on."}], max_tokens=1)
    assert expected.reasoning_content, "the tiny thinker wrote no reasoning"
    thinking = [b.thinking for b in message.content if b.type == "thinking"]
    assert thinking == [expected.reasoning_content] and message.content[0].type == "thinking"
    assert "".join(b.text for b in message.content if b.type == "text") == (expected.content or "")
    streamed_thinking = "".join(e.delta.thinking for e in events
                                if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert streamed_thinking == expected.reasoning_content and text == (expected.content or "")
    assert again.usage.input_tokens == without.usage.prompt_tokens


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(long_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineConfig(model=str(long_model)))
    gate = StepGate(engine, monkeypatch)
    gate.allow(8)  # the reply's first text, then its steps held until the drain has begun
    app = build_app(engine, MODEL)
    body = {"model": MODEL, "max_tokens": 900, "messages": USER, "stream": True, "temperature": 0}
    with serve_app(app) as url, httpx.stream("POST", f"{url}/v1/messages", json=body, trust_env=False,
                                             timeout=60) as response:
        lines: list[str] = []
        for line in response.iter_lines():
            lines.append(line)
            if line == "event: content_block_delta" and lines.count(line) == 1:
                app.state.manager.drain(0)  # as a second SIGTERM does: every running request ends at once
                gate.allow()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}


def test_a_tool_call_cut_by_max_tokens_is_left_out(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, tools=TOOLS,
                                     messages=[{"role": "user", "content": "Weather?"}],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.content == [] and message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_count_tokens_is_the_prompt_a_message_would_have(client: anthropic.Anthropic, base_url: str) -> None:
    system = "Be brief."
    message = client.messages.create(model=MODEL, max_tokens=1, system=system, messages=USER, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=USER)
    assert counted.input_tokens == message.usage.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS)
    called = client.messages.create(model=MODEL, max_tokens=1, messages=USER, tools=TOOLS, extra_body=GREEDY)
    assert with_tools.input_tokens == called.usage.input_tokens > client.messages.count_tokens(
        model=MODEL, messages=USER).input_tokens
    refused = httpx.post(f"{base_url}/v1/messages/count_tokens", trust_env=False, timeout=60,
                         json={"model": MODEL, "messages": USER, "thinking": {"type": "enabled"}})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "unsupported field 'thinking'" in refused.json()["error"]["message"]
