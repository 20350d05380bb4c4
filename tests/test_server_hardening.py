"""The server against careless and hostile clients (issue 23's repros), through a real uvicorn
server: body limits, sequence caps, inputs that used to give 500s or pass as garbage, roles,
unsupported fields, the API key, CORS, the OpenAPI document and the metrics an operator needs."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from server_helpers import metric, serve_app, served

MODEL = "tiny-llama"
PROMPT = "The cat sees a red apple"
MESSAGES = [{"role": "user", "content": "Where do penguins live?"}]
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    options = ServerOptions(max_inflight_requests=16, max_request_body_mb=1, max_sequences_per_request=64)
    with serve_app(build_app(served(EngineConfig(model=str(model_dir), num_kv_blocks=128)), MODEL, options)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---- 1. one request must not freeze the server --------------------------------------------------
def test_an_oversized_body_is_a_413_while_a_stream_and_health_keep_going(base_url: str, http: httpx.Client) -> None:
    chunks: list[str] = []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    def stream() -> None:
        with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            chunks.extend(r.iter_lines())

    reader = threading.Thread(target=stream)
    reader.start()
    while not chunks:
        time.sleep(0.01)
    rejected = metric(http, "roseinfer_requests_rejected_total", reason="too_large")
    huge = json.dumps({"prompt": "hello " * 900_000, "max_tokens": 8}).encode()  # 5.4 MB against a 1 MB limit
    error = _error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 413)
    assert "larger than the server's limit" in error["message"]
    assert http.get("/health").status_code == 200
    assert metric(http, "roseinfer_requests_rejected_total", reason="too_large") == rejected + 1
    reader.join(timeout=60)
    events = [line for line in chunks if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 200


# ---- 2. sequences per request ---------------------------------------------------------------------
def test_more_sequences_than_can_ever_run_is_a_400_not_a_429(http: httpx.Client) -> None:
    error = _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 17}), 400)
    assert error["param"] == "n" and "--max-inflight-requests" in error["message"]
    error = _error(http.post("/v1/completions", json={"prompt": ["hi"] * 100, "n": 2}), 400)
    assert error["param"] == "n" and "at most 64" in error["message"]
    error = _error(http.post("/v1/completions", json={"prompt": ["hi"] * 65}), 400)
    assert error["param"] == "prompt"


# ---- 3. what used to be a 500 ---------------------------------------------------------------------
@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "hi\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi\\ud800"}]}', "messages"),
    ("/tokenize", b'{"prompt": "hi\\udfff"}', "prompt"),
    ("/v1/completions", "{\"prompt\": \"hi\", \"logit_bias\": {\"\u00b2\": 1}}".encode(), "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551615, "n": 2}', "seed"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551615, "n": 2, "stream": true}', "seed"),
    # 4. garbage that used to pass
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "top_p"),
    # 6. loose validation
    ("/v1/chat/completions", b'{"messages": [{"role": "bogus", "content": "hi"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "42"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {}}',
     "response_format"),
    ("/v1/completions", b'{"prompt": "hi", "best_of": 2}', "best_of"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_connection_lives(http: httpx.Client, path: str, raw: bytes,
                                                                      param: str) -> None:
    error = _error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert error["param"] == param and error["message"]
    assert http.get("/health").status_code == 200  # the same kept-alive connection still answers


def test_unsupported_fields_are_named_and_tool_messages_with_their_id_pass(http: httpx.Client) -> None:
    error = _error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "web_search_options": {}}), 400)
    assert error["message"] == "unsupported field 'web_search_options': web search is not supported"
    error = _error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "logit_bias_typo": {}}), 400)
    assert error["message"] == "unsupported field 'logit_bias_typo': roseinfer does not implement it"
    history = [*MESSAGES, {"role": "assistant", "content": "In the south."},
               {"role": "tool", "content": "{}", "tool_call_id": "call_1"}]
    assert http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2}).status_code == 200


def test_a_temperature_below_epsilon_samples_greedily(http: httpx.Client) -> None:
    def text(temperature: float) -> str:
        body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": temperature}
        return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

    assert text(1e-45) == text(0.0)


# ---- 7. authentication, CORS, the model card --------------------------------------------------------
def test_api_key_guards_the_api_but_not_health_or_metrics(model_dir: Path) -> None:
    options = ServerOptions(api_key=KEY, allowed_origins=["https://app.example"])
    with serve_app(build_app(served(EngineConfig(model=str(model_dir), num_kv_blocks=32)), MODEL, options)) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                error = _error(c.request(method, path, json=body, headers=headers), 401)
                assert error["code"] == "invalid_api_key"
            assert c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        preflight = c.options("/v1/completions", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert metric(c, "roseinfer_requests_rejected_total", reason="unauthorized") == 12


def test_no_cors_headers_unless_origins_are_allowed_and_the_model_root_is_as_named(http: httpx.Client,
                                                                                  model_dir: Path) -> None:
    resp = http.get("/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert "access-control-allow-origin" not in resp.headers
    assert resp.json()["data"][0]["root"] == str(model_dir)  # not the converted cache folder


# ---- 8. metrics ---------------------------------------------------------------------------------------
def test_metrics_show_kv_blocks_preemptions_and_rejections(model_dir: Path) -> None:
    options = ServerOptions(max_inflight_requests=4)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=12))  # 4 x 100 tokens need 28 blocks
    with serve_app(build_app(engine, MODEL, options)) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        assert metric(c, "roseinfer_kv_cache_free_blocks") == 12 and metric(c, "roseinfer_kv_cache_used_blocks") == 0
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "n": 4}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert metric(c, "roseinfer_num_preemptions_total") > 0
        _error(c.post("/v1/completions", json={**body, "n": 5}), 400)
        assert metric(c, "roseinfer_requests_rejected_total", reason="invalid") == 1
        assert metric(c, "roseinfer_kv_cache_used_blocks") == 0


# ---- the OpenAPI document -----------------------------------------------------------------------------
def test_the_openapi_document_lists_the_errors_sent_and_the_constraints(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "413", "429", "503"} <= set(completions)
    assert completions["413"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    top_p = next(s for s in fields["top_p"]["anyOf"] if s.get("type") == "number")
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert doc["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False
