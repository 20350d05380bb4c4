"""No request may stall the others (issue 35, items 1 and 6), through a real uvicorn server.

Where a request used to hold the event loop, the work it does now is held open by construction (a
gate that opens only once /health has answered), so the test fails, rather than hangs forever, if
that work ever runs on the loop again. The requests that stalled the server (100,000 choices, 3.4
million one-token prompts, 490,000 messages, a 16 MB /detokenize, ...) each get a 400 that names
their limit while a stream keeps going. A constraint llguidance gives up on at its first token is a
400 before generation, one it gives up on later ends with an error in OpenAI's shape instead of a
200 with finish_reason "abort", and one nested deeper than a thread's stack compiles without
crashing the server."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Iterator

import httpx
import pytest

import roseinfer.server.serving as serving_module
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from roseinfer.server.request_body import (MAX_CHOICES, MAX_JSON_CONTAINERS, MAX_JSON_VALUES, MAX_LOGIT_BIAS,
                                           MAX_MESSAGES, MAX_STOP)
from server_helpers import serve_app

MODEL = "tiny-llama"
GATE_TIMEOUT_S = 60  # how long gated work waits for /health before the test fails


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), num_kv_blocks=128))


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine) -> Iterator[str]:
    # compiles that llguidance gives up on take seconds on a busy machine: no time limit to race here
    # (the limit has its own test, slow by construction)
    with serve_app(build_app(engine, MODEL, ServerOptions(constraint_compile_timeout=600))) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as client:
        yield client


def _error(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text[:500]
    return resp.json()["error"]


class Gate:
    """Wraps a function so that each call waits, in whatever thread runs it, until /health has
    answered: were that thread the event loop, /health could never answer and the wait would fail."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.entered.set()
        assert self.opened.wait(GATE_TIMEOUT_S), "/health never answered while this work was held"
        return self.fn(*args, **kwargs)

    def probe_health(self, http: httpx.Client) -> None:
        assert self.entered.wait(GATE_TIMEOUT_S), "the gated work never started"
        assert http.get("/health", timeout=GATE_TIMEOUT_S / 2).status_code == 200
        self.opened.set()


def _post_in_thread(base_url: str, path: str, body: dict[str, Any]) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as c:
            out.append(c.post(path, json=body))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, out


# ---- work a request carries runs off the event loop ----------------------------------------------------
def test_a_body_is_parsed_and_validated_off_the_event_loop(base_url: str, http: httpx.Client,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(serving_module.parse_body)
    monkeypatch.setattr(serving_module, "parse_body", gate)
    thread, out = _post_in_thread(base_url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    gate.probe_health(http)
    thread.join(timeout=120)
    assert out[0].status_code == 200 and out[0].json()["usage"]["completion_tokens"] == 2


def test_a_long_valid_prompt_is_tokenized_off_the_event_loop(base_url: str, http: httpx.Client, engine: LLMEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0.9 MB prompt (under the body limit, far over the context) is tokenized in a worker thread,
    then refused with its 400."""
    gate = Gate(engine.tokenizer.encode)
    monkeypatch.setattr(engine.tokenizer, "encode", gate)
    thread, out = _post_in_thread(base_url, "/v1/completions", {"prompt": "a red apple " * 75_000})
    gate.probe_health(http)
    thread.join(timeout=120)
    assert "context length" in _error(out[0], 400)["message"]


def test_a_constraint_is_compiled_off_the_event_loop_once(base_url: str, http: httpx.Client, engine: LLMEngine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled in the request's thread, and the engine takes that grammar rather than compiling again."""
    gate = Gate(engine.compile_grammar)
    monkeypatch.setattr(engine, "compile_grammar", gate)
    body = {"prompt": "hello", "max_tokens": 8, "guided_choice": ["left turn", "right turn", "straight on"]}
    thread, out = _post_in_thread(base_url, "/v1/completions", body)
    gate.probe_health(http)
    thread.join(timeout=120)
    assert out[0].status_code == 200 and out[0].json()["choices"][0]["text"] in body["guided_choice"]
    assert gate.calls == 1


def test_a_constraint_that_compiles_too_long_is_a_400_naming_the_limit(tiny_model_factory,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile is held until the answer is in: over the limit by construction, however fast the machine."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), num_kv_blocks=16))
    gate = Gate(engine.compile_grammar)
    monkeypatch.setattr(engine, "compile_grammar", gate)
    with serve_app(build_app(engine, MODEL, ServerOptions(constraint_compile_timeout=0.2))) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=120) as c:
        resp = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "guided_regex": "[a-z]{3}"})
        gate.opened.set()
        error = _error(resp)
    assert error["param"] == "guided_regex" and "--constraint-compile-timeout" in error["message"]


# ---- the requests that stalled the server: each a 400 naming its limit, while a stream goes on --------
def _many(item: str, count: int) -> str:
    return "[" + ",".join([item] * count) + "]"


STALLERS = [  # (path, raw JSON body, param, words in the message)
    ("/v1/completions", '{"prompt": "a", "guided_choice": %s}' % _many('"w"', 100_000), "guided_choice",
     f"at most {MAX_CHOICES}"),
    ("/v1/completions", '{"prompt": "a", "structured_outputs": {"choice": %s}}' % _many('"w"', 1001),
     "structured_outputs.choice", f"at most {MAX_CHOICES}"),
    ("/v1/completions", json.dumps({"prompt": "a", "guided_grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(100_000))}), "guided_grammar", "--max-constraint-bytes"),
    ("/v1/completions", json.dumps({"prompt": "a", "guided_json": json.dumps(
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20_000)}})}), "guided_json",
     "--max-constraint-bytes"),
    ("/v1/completions", '{"prompt": %s}' % _many("[5]", 3_400_000), None,
     f"more than {MAX_JSON_CONTAINERS} JSON arrays and objects"),
    ("/v1/completions", '{"prompt": %s}' % _many("[5]", 50_000), "prompt", "--max-sequences-per-request"),
    ("/v1/completions", '{"prompt": %s}' % _many("5", 100_000), "prompt", "the model's context"),
    ("/v1/chat/completions", '{"messages": %s}' % _many('{"role": "user", "content": "a"}', 490_000), None,
     "JSON arrays and objects"),
    ("/v1/chat/completions", '{"messages": %s}' % _many('{"role": "user", "content": "a"}', MAX_MESSAGES + 1),
     "messages", f"at most {MAX_MESSAGES}"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % _many(
        '{"type": "text", "text": "a"}', MAX_MESSAGES + 1), "messages", "content parts and tool calls"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": _many("[5]", 200_000)}}]}]}),
     "messages", "a tool call's arguments"),
    ("/v1/completions", json.dumps({"prompt": "a", "stop": [f"s{i}" for i in range(MAX_STOP + 1)]}), "stop",
     f"at most {MAX_STOP}"),
    ("/v1/completions", json.dumps({"prompt": "a", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}),
     "logit_bias", f"at most {MAX_LOGIT_BIAS}"),
    ("/v1/completions", json.dumps({"prompt": "a", "stop_token_ids": [5] * 100_000}), "stop_token_ids",
     "the model's context"),
    ("/detokenize", '{"tokens": %s}' % _many("5", 8_000_000), None, f"more than {MAX_JSON_VALUES} JSON values"),
    ("/detokenize", '{"tokens": %s}' % _many("5", 300_000), "tokens", "the model's context"),
    ("/tokenize", '{"messages": %s}' % _many('{"role": "user", "content": "a"}', MAX_MESSAGES + 1), "messages",
     f"at most {MAX_MESSAGES}"),
    ("/v1/completions", '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", None, "nested too deeply"),
]


@pytest.mark.parametrize("path,raw,param,words", STALLERS,
                         ids=["choices", "so-choices", "grammar", "json-text", "prompts-3.4M", "prompts", "token-ids",
                              "messages-490k", "messages", "content-parts", "arguments", "stop", "logit-bias", "stop-token-ids",
                              "detokenize-16MB", "detokenize", "tokenize", "deep"])
def test_a_request_that_stalled_the_server_is_a_400_naming_its_limit(base_url: str, http: httpx.Client, path: str,
                                                                     raw: str, param: str | None, words: str) -> None:
    """Refused while a stream is under way (a chat with no max_tokens: the whole context), which
    then runs to its end untouched."""
    lines: list[str] = []
    started = threading.Event()
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60)
        error = _error(http.post(path, content=raw.encode(), headers={"content-type": "application/json"}))
        assert error["param"] == param and words in error["message"], error
        assert http.get("/health").status_code == 200
    finally:
        reader.join(timeout=120)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(http: httpx.Client, fields: dict,
                                                                    param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    error = _error(http.post("/v1/chat/completions", json=body))
    assert error["param"] == param and "cannot be enforced" in error["message"]


def test_a_grammar_nested_deeper_than_a_threads_default_stack_compiles(http: httpx.Client) -> None:
    """A 6,000-rule chain (100 KB) crashed the process compiling on an 8 MB stack (SIGSEGV)."""
    grammar = "\n".join(["start: r0"] + [f'r{i}: "a" r{i + 1}' for i in range(6000)] + ['r6000: "y"'])
    resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "guided_grammar": grammar})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "aaaa", resp.text[:300]
    assert http.get("/health").status_code == 200


# ---- item 6: a constraint llguidance gives up on -------------------------------------------------------
@pytest.mark.parametrize("regex", ["a{1000000}", "((a{100}){100}){100}", "xa{1000000}"])
def test_a_constraint_given_up_on_at_its_first_token_is_a_400_before_generation(http: httpx.Client,
                                                                                 regex: str) -> None:
    error = _error(http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "guided_regex": regex}))
    assert error["param"] == "guided_regex" and "gives up on it at its first token" in error["message"]


# 20 letters fill more than a token can, so the first tokens pass; llguidance gives up on a{1000000} once
# a mask reaches it. The tail makes the grammar long, to show that neither the log nor the error quotes it.
LATE_FAILURE = "[b-z]{20}a{1000000}" + "c" * 5000


def test_a_constraint_that_fails_while_generating_is_an_error_not_an_abort(http: httpx.Client,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "hello", "max_tokens": 40, "guided_regex": LATE_FAILURE}
    with caplog.at_level(logging.INFO):
        error = _error(http.post("/v1/completions", json=body))
    assert error["type"] == "invalid_request_error" and "failed while generating" in error["message"]
    assert len(error["message"]) < 500 and all(len(r.getMessage()) < 1000 for r in caplog.records)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "failed while generating" in json.loads(events[-2])["error"]["message"]
    assert all('"abort"' not in event for event in events)
