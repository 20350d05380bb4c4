"""Structured output through the server: every request form (OpenAI's response_format, vLLM's
structured_outputs and guided_*) to its StructuredOutputsParams, the 400s, and outputs that validate,
streamed and not, through the official openai client (parse into a pydantic model included).

The tiny model is random: its free output is noise, so whatever validates does so because of the
constraint. Schemas are bounded (maxLength, enums, integer ranges) so that it always finishes."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from roseinfer.config import EngineConfig
from roseinfer.sampling_params import StructuredOutputsParams
from roseinfer.server.app import build_app
from roseinfer.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from roseinfer.server.structured import requested_constraint
from server_helpers import model_copy, openai_client, serve_app, served

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "The weather in Paris, as JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
MAX_TOKENS = 120  # far more than a bounded schema needs


class Weather(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)


# ---- request fields -> StructuredOutputsParams --------------------------------------------------
def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("fields,field,expected", [
    ({"response_format": {"type": "json_object"}}, "response_format", StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}},
     "response_format", StructuredOutputsParams(json=WEATHER)),
    ({"structured_outputs": {"json": json.dumps(WEATHER)}}, "structured_outputs",
     StructuredOutputsParams(json=WEATHER)),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, "structured_outputs", StructuredOutputsParams(regex="[a-z]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs",
     StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "structured_outputs",
     StructuredOutputsParams(grammar='start: "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs", StructuredOutputsParams(json_object=True)),
    ({"guided_json": WEATHER}, "guided_json", StructuredOutputsParams(json=WEATHER)),
    ({"guided_regex": "[0-9]+"}, "guided_regex", StructuredOutputsParams(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, "guided_choice", StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "x"'}, "guided_grammar", StructuredOutputsParams(grammar='start: "x"')),
])
def test_each_request_form_maps_to_its_constraint(fields: dict, field: str, expected: StructuredOutputsParams) -> None:
    for body in (chat(**fields), CompletionRequest.model_validate({"prompt": "hi", **fields})):
        got = requested_constraint(body)
        assert got is not None and got.params == expected and got.field == field


def test_text_format_and_no_format_constrain_nothing() -> None:
    assert requested_constraint(chat(response_format={"type": "text"})) is None
    assert requested_constraint(chat()) is None


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
])
def test_bad_constraints_are_a_400_naming_the_field(fields: dict, param: str, words: str) -> None:
    with pytest.raises(APIError) as caught:
        requested_constraint(chat(**fields))
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


# ---- through the server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = model_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("structured") / "llama",
                       max_position_embeddings=1024)
    with serve_app(build_app(served(EngineConfig(model=str(model))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_streamed_and_not(client: openai.OpenAI, temperature: float) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, response_format=SCHEMA_FORMAT, max_tokens=MAX_TOKENS,
                  temperature=temperature, seed=3)
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), WEATHER)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    resp = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather,
                                         max_tokens=MAX_TOKENS, temperature=0)
    weather = resp.choices[0].message.parsed
    assert isinstance(weather, Weather) and weather.unit in ("c", "f") and 1 <= weather.days <= 7


def test_json_object_is_any_object(client: openai.OpenAI) -> None:
    # an object with free keys may go on for long; what was generated must be a JSON object's start
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                          max_tokens=MAX_TOKENS, temperature=0)
    content = resp.choices[0].message.content
    assert content.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("fields,check", [
    ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda text: text in ("alpha", "beta", "gamma")),
    ({"guided_regex": "[a-c]{2,5}-[0-9]{1,3}"}, lambda text: re.fullmatch("[a-c]{2,5}-[0-9]{1,3}", text)),
    ({"structured_outputs": {"grammar": 'start: "x" ("+" "x"){0,3}'}}, lambda text: re.fullmatch(r"x(\+x){0,3}", text)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
     lambda text: jsonschema.validate(json.loads(text), WEATHER) is None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_form(http: httpx.Client, fields: dict, check: Any, stream: bool) -> None:
    body = {"prompt": "Answer:", "max_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "seed": 1, "stream": stream,
            **fields}
    if stream:
        texts = ["", ""]
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts[choice["index"]] += choice["text"]
    else:
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        texts = [c["text"] for c in resp.json()["choices"]]
    assert all(check(text) for text in texts), texts


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_json": WEATHER, "response_format": {"type": "json_object"}},
     "guided_json"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "w"}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "structural_tag"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(("}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_a_400_before_any_stream(http: httpx.Client, path: str, body: dict, param: str,
                                                     stream: bool) -> None:
    resp = http.post(path, json={**body, "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
