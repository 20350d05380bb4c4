"""/v1/embeddings through the official openai client: each input's vector is LLM.embed's (which
test_embeddings.py checks against HF transformers), as floats and as base64, for a string, a list
of strings and token ids; the KV blocks are free afterwards; refusals name the field."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy
import openai
import pytest
import torch

from roseinfer import LLM, PoolingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from server_helpers import openai_client, serve_app

MODEL = "tiny-llama"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Paris is the capital of France."]
ATOL = 1e-5  # test_embeddings.py's bound: the server's steps batch the inputs as LLM.embed's may not


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[float]]:
    return [out.outputs.embedding for out in LLM(str(model_dir), num_kv_blocks=64).embed(TEXTS, use_tqdm=False)]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine) -> Iterator[str]:
    with serve_app(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=ATOL, rtol=0)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_a_list_of_strings_gives_llm_embeds_vectors(client: openai.OpenAI, engine: LLMEngine,
                                                    expected: list[list[float]], encoding_format: str | None) -> None:
    # unset, the client asks for base64 and decodes it itself; asked for, it is left to the caller
    response = client.embeddings.create(model=MODEL, input=TEXTS,
                                        **({"encoding_format": encoding_format} if encoding_format else {}))
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
    for data, want in zip(response.data, expected):
        got = data.embedding
        if encoding_format == "base64":
            got = numpy.frombuffer(base64.b64decode(got), dtype="<f4").tolist()
        close(got, want)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_a_string_and_token_ids_are_one_input_each(client: openai.OpenAI, engine: LLMEngine,
                                                   expected: list[list[float]]) -> None:
    [one] = client.embeddings.create(model=MODEL, input=TEXTS[0]).data
    close(one.embedding, expected[0])
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL, input=ids).data
    for data, want in zip(by_ids, expected):
        close(data.embedding, want)
    [single] = client.embeddings.create(model=MODEL, input=ids[1]).data
    close(single.embedding, expected[1])
    hidden = engine.model_config.hidden_size
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=hidden).data[0].embedding) == hidden


@pytest.mark.parametrize("body, param", [
    ({"dimensions": 3}, "dimensions"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": [[10 ** 9]]}, None),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
])
def test_refusals_name_the_field(base_url: str, body: dict[str, Any], param: str | None) -> None:
    response = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, "input": "Hi", **body},
                          trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_matryoshka_checkpoint_serves_its_shorter_vectors(model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mrl"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    [want] = LLM(str(folder), num_kv_blocks=64).embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64))
    with serve_app(build_app(engine, MODEL)) as url:
        [got] = openai_client(url).embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16).data
        close(got.embedding, want.outputs.embedding)
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "Hi", "dimensions": 24}, trust_env=False,
                             timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    assert "one of [16, 32, 64]" in refused.json()["error"]["message"]
    assert engine.kv_cache_stats()["used_blocks"] == 0
