"""Issue 35's API items through a real uvicorn server: logprobs under output constraints (finite
numbers only, masked alternatives left out), every 5xx counted in /metrics, unpaired surrogates in
free-form JSON (400s), stream_options.continuous_usage_stats, /tokenizer_info (vLLM's shape,
behind --api-key) and an OpenAPI document that agrees with the server."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from roseinfer.config import EngineConfig
from roseinfer.engine.request import TokenLogprobs
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from roseinfer.server.logprobs import LogprobsFormatter
from roseinfer.server.metrics import RouterMetrics, ServerMetrics
from roseinfer.tokenizer import Tokenizer
from server_helpers import metric, model_copy, openai_client, serve_app, served

MODEL = "tiny-llama"
KEY = "unused"  # the key openai_client sends: the server runs with --api-key, so /tokenizer_info is guarded
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Yes or no?"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # room for the tools the tool_choice case shows the model
    return model_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("api_fields") / "llama",
                      max_position_embeddings=1024)


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    options = ServerOptions(api_key=KEY, max_inflight_requests=16)
    with serve_app(build_app(served(EngineConfig(model=str(model_dir), num_kv_blocks=128)), MODEL, options)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=120, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and ±Infinity, as JSON.parse does."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def events(resp: httpx.Response) -> list[Any]:
    """The data events of an SSE response, each parsed strictly; the last is [DONE]."""
    lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [strict_json(line) for line in lines[:-1]]


# ---- logprobs under an output constraint -------------------------------------------------------
CONSTRAINTS = {
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_regex": {"guided_regex": "(ab|cd)e"},
    "guided_grammar": {"guided_grammar": 'start: "north" | "south"'},
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "yn", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}},
    "tool_choice_required": {"tools": TOOLS, "tool_choice": "required"},
}


def check_chat_logprobs(logprobs: list[dict[str, Any]]) -> int:
    """Every number finite; returns the fewest alternatives any position kept (of 20 asked for)."""
    fewest = 20
    for position in logprobs:
        assert math.isfinite(position["logprob"]) and position["logprob"] <= 0
        values = [top["logprob"] for top in position["top_logprobs"]]
        assert all(math.isfinite(v) and v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4  # one distribution, the grammar's
        fewest = min(fewest, len(values))
    return fewest


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_chat_logprobs_under_a_constraint_are_finite_streamed_and_not(http: httpx.Client, constraint: str) -> None:
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 20, "max_tokens": 40, "seed": 1,
            "temperature": 1.0, **CONSTRAINTS[constraint]}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = strict_json(resp.text)["choices"][0]
    # the grammar allows a handful of tokens at each step: the masked ones are left out, not sent as -inf
    assert check_chat_logprobs(choice["logprobs"]["content"]) < 20
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        chunks = events(streamed)
    streamed = [entry for chunk in chunks for c in chunk["choices"] if c.get("logprobs")
                for entry in c["logprobs"]["content"]]
    check_chat_logprobs(streamed)
    # the same seed, the same tokens (the numbers to float32 rounding: the prefix cache computes fewer rows)
    assert [e["token"] for e in streamed] == [e["token"] for e in choice["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]],
                                                             abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_under_a_constraint_are_finite(http: httpx.Client, stream: bool) -> None:
    body = {"prompt": "Answer:", "logprobs": 5, "max_tokens": 8, "guided_choice": ["yes", "no"], "stream": stream,
            "seed": 2}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        parts = events(resp) if stream else [strict_json(resp.read())]
    logprobs = [c["logprobs"] for part in parts for c in part["choices"] if c["logprobs"]]
    text = "".join(c["text"] for part in parts for c in part["choices"])
    assert text in ("yes", "no")
    tokens = [t for lp in logprobs for t in lp["tokens"]]
    values = [v for lp in logprobs for v in lp["token_logprobs"]]
    tops = [top for lp in logprobs for top in lp["top_logprobs"]]
    assert "".join(tokens) == text and all(math.isfinite(v) for v in values)
    assert all(math.isfinite(v) for top in tops for v in top.values())
    # only what the grammar allowed: fewer than the 5 asked for, and a forced last token alone, at log 1
    assert all(len(top) < 5 for top in tops)
    assert len(tokens) == 1 or tops[-1] == {tokens[-1]: 0.0}


def test_a_non_finite_logprob_never_leaves_the_server(model_dir: Path) -> None:
    """What the engine gives a constrained row whose grammar masked everything (NaN) or the
    chosen token (-inf): the formatter's floor and filter, on the three shapes."""
    formatter = LogprobsFormatter(Tokenizer(model_dir))
    entry = TokenLogprobs(5, float("-inf"), 3, [(7, -0.1), (5, float("-inf")), (9, float("nan"))])
    chat = formatter.chat([entry])["content"][0]
    assert chat["logprob"] == -9999.0 and [t["logprob"] for t in chat["top_logprobs"]] == [-0.1]
    completion = formatter.completion([(5, entry)], 0, 3)
    assert completion["token_logprobs"] == [-9999.0] and list(completion["top_logprobs"][0].values()) == [-0.1]
    prompt = formatter.prompt([None, entry], 3)[1]
    assert prompt[5]["logprob"] == -9999.0 and prompt[7] == {"logprob": -0.1, "rank": 1,
                                                            "decoded_token": formatter.token_text(7)}
    strict_json(json.dumps([chat, completion, {str(k): v for k, v in prompt.items()}]))


# ---- /metrics counts every response by status class ----------------------------------------------
def test_every_5xx_is_counted(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    def count(status: str) -> float:
        return metric(http, "roseinfer_http_responses_total", status=status)

    before = {status: count(status) for status in ("2xx", "4xx", "5xx")}
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400

    def broken(*_: Any) -> Any:  # a bug while formatting, after the generation ran
        raise RuntimeError("formatter bug")

    monkeypatch.setattr(LogprobsFormatter, "chat", broken)
    with httpx.Client(base_url=str(http.base_url), trust_env=False, headers=AUTH) as once:  # uvicorn closes it after
        failed = once.post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True, "max_tokens": 2})
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    # each scrape is a 2xx of its own, counted before the next one reads
    assert count("4xx") == before["4xx"] + 1 and count("5xx") == before["5xx"] + 1
    assert count("2xx") >= before["2xx"] + 1


# ---- unpaired surrogates in free-form JSON -------------------------------------------------------
LONE = "\\ud800"  # as it arrives: a JSON escape, which Python decodes to a lone surrogate
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


def raw(obj: Any) -> bytes:
    """JSON bytes with every "@" turned into the escape of a lone surrogate."""
    return json.dumps(obj).replace("@", LONE).encode()


def with_arguments(arguments: str) -> dict:
    return {"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {**CALL["function"], "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "max_tokens": 1}


def tools_with(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": tools_with({"properties": {"z@": {}}})}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": tools_with({"description": ["x@"]})}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "tools": tools_with({"properties": {"z": {"title": "@"}}})}, "tools"),
    # the arguments are JSON text: the escape is inside it, decoded only when the server parses it
    ("/v1/chat/completions", with_arguments('{"zone": "%s"}' % LONE), "messages"),
    ("/v1/chat/completions", with_arguments('{"%s": 1}' % LONE), "messages"),
    ("/tokenize", {"messages": with_arguments('{"%s": 1}' % LONE)["messages"]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"@": {"type": "string"}}}}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"enum": ["@"]}}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"const": "@"}}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi", "annotations": [{"@": 1}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "metadata": {"k@": "v"}}, "metadata"),
])
def test_a_lone_surrogate_in_free_form_json_is_a_400(http: httpx.Client, path: str, body: dict, param: str) -> None:
    resp = http.post(path, content=raw(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "unpaired surrogate" in error["message"]


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_lone_surrogate_in_a_json_schema_sent_as_text_is_a_400(http: httpx.Client, field: str) -> None:
    schema_text = '{"enum": ["%s"]}' % LONE  # JSON text holding the escape
    body = {"prompt": "hi", field: schema_text if field == "guided_json" else {"json": schema_text}}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field and "\\ud800" in resp.json()["error"]["message"]


# ---- stream_options.continuous_usage_stats -------------------------------------------------------
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    prompt = chunks[0].usage.prompt_tokens
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 12  # the role chunk, then so far
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-2].usage == chunks[-1].usage  # the last content chunk has it all


@pytest.mark.parametrize("options", [{"include_usage": True, "continuous_usage_stats": False},
                                     {"continuous_usage_stats": True}])
def test_continuous_usage_stats_off_or_without_include_usage_changes_nothing(client: openai.OpenAI,
                                                                            options: dict) -> None:
    """false is accepted (guidellm sends it) and behaves as before, as vLLM does without include_usage."""
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options=options))
    usages = [chunk.usage for chunk in chunks]
    if options.get("include_usage"):
        assert usages[:-1] == [None] * (len(chunks) - 1) and usages[-1].completion_tokens == 6
    else:
        assert usages == [None] * len(chunks)


def test_completions_stream_usage_in_every_chunk_with_n(http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        chunks = events(resp)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 10  # the request's totals: both choices


# ---- /tokenizer_info ------------------------------------------------------------------------------
def test_tokenizer_info_in_vllms_shape_behind_the_api_key(http: httpx.Client, base_url: str, model_dir: Path) -> None:
    with httpx.Client(base_url=base_url, trust_env=False) as anonymous:
        denied = anonymous.get("/tokenizer_info")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    info = http.get("/tokenizer_info").json()
    tokenizer = Tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] and info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.special_tokens["eos_token"]  # lm-evaluation-harness requires the key
    assert info["model_max_length"] == config["model_max_length"] and "sep_token" in info
    # what lm-evaluation-harness's remote tokenizer then does: render the template itself, ids from /tokenize
    rendered = ImmutableSandboxedEnvironment().from_string(info["chat_template"]).render(
        messages=MESSAGES, add_generation_prompt=True)
    by_text = http.post("/tokenize", json={"prompt": rendered, "add_special_tokens": False}).json()["tokens"]
    assert by_text == http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    eos_ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos_ids[0] in tokenizer.eos_token_ids


# ---- the OpenAPI document and the server agree ---------------------------------------------------
@pytest.fixture(scope="module")
def request_schemas(http: httpx.Client) -> dict[str, jsonschema.protocols.Validator]:
    document = http.get("/openapi.json").json()
    validators = {}
    for path, operations in document["paths"].items():
        body = operations.get("post", {}).get("requestBody")
        if body:
            schema = {**body["content"]["application/json"]["schema"], "components": document["components"]}
            validators[path] = jsonschema.Draft202012Validator(schema)
    return validators


@pytest.mark.parametrize("path, body", [
    # schemathesis' ST202 shapes (issue 35), each with a neighbour the other way
    ("/detokenize", {"tokens": [0.0, 5.0]}),
    ("/detokenize", {"tokens": [0.5]}),
    ("/detokenize", {"tokens": [True]}),
    ("/detokenize", {"tokens": [-1.0]}),  # 2.0 taken, but the bounds still stated as the server enforces them
    ("/v1/completions", {"prompt": [[-4]]}),
    ("/v1/completions", {"prompt": [[4.0], [5]], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42", "tool_call_id": ""}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "42"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": None}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": ["hi", ""]}),
    ("/v1/completions", {"prompt": "", "max_tokens": 0, "echo": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": False}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": None}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "2"}),
    ("/tokenize", {}),
    ("/tokenize", {"prompt": None}),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}),
    ("/tokenize", {"prompt": "hi", "messages": None}),
    ("/tokenize", {"messages": MESSAGES}),
])
def test_the_openapi_document_accepts_what_the_server_accepts(http: httpx.Client, request_schemas: dict,
                                                             path: str, body: dict) -> None:
    accepted = http.post(path, json=body).status_code == 200
    assert request_schemas[path].is_valid(body) == accepted, (body, accepted)


def test_with_replicas_responses_are_counted_once_at_the_ingress() -> None:
    """A replica's own (never incremented) roseinfer_http_responses family is not merged in beside
    the ingress's, as with roseinfer_requests_rejected."""
    replica, router = ServerMetrics(), RouterMetrics()
    replica.responses.labels("2xx").inc(7)  # what a replica would show if anything counted there
    router.responses.labels("5xx").inc()
    text = router.render([0], {0: generate_latest(replica.registry)}).decode()
    samples = [s for family in text_string_to_metric_families(text) if family.name == "roseinfer_http_responses"
               for s in family.samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in samples] == [({"status": "5xx"}, 1.0)]
