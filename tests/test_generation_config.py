"""The model's generation_config.json supplies the sampling defaults a request leaves unset, as in
vLLM: `--generation-config auto|vllm|FOLDER` picks the file, `--override-generation-config` wins."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.loader.generation_config import sampling_defaults
from roseinfer.server.app import build_app

from server_helpers import serve_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory) -> Path:
    """The tiny llama with a generation config that sets greedy and 3 new tokens."""
    out = tmp_path_factory.mktemp("genconfig") / "llama"
    shutil.copytree(tiny_model_factory("llama"), out)
    config = json.loads((out / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.0, top_k=7, max_new_tokens=3)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def test_sampling_defaults_come_from_the_file_and_the_override_wins(model_dir: Path, tmp_path: Path) -> None:
    # do_sample, bos/eos/pad ids: not sampling defaults (vLLM reads the same six keys)
    assert sampling_defaults(model_dir, "auto", None) == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    assert sampling_defaults(model_dir, "vllm", None) == {}
    assert sampling_defaults(model_dir, "auto", {"max_new_tokens": 9, "top_p": 0.5}) == {
        "temperature": 0.0, "top_k": 7, "top_p": 0.5, "max_tokens": 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert sampling_defaults(model_dir, str(tmp_path), None) == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="does not exist"):
        sampling_defaults(model_dir, str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match="unknown key.*do_sample"):
        sampling_defaults(model_dir, "auto", {"do_sample": False})


def test_llm_without_sampling_params_uses_the_models_defaults(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), num_kv_blocks=32)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=7, max_tokens=3)
    out = llm.generate(["hello there"])[0]
    explicit = llm.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == explicit.token_ids[:len(out.token_ids)] and len(out.token_ids) <= 3
    assert LLM(model=str(model_dir), num_kv_blocks=32, generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()


def test_a_bad_default_fails_at_engine_start(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="generation config's sampling defaults: temperature must be >= 0"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32,
                               override_generation_config={"temperature": -1.0}))


def test_server_fields_left_unset_take_the_models_defaults(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64,
                                    override_generation_config={"max_new_tokens": 4}))
    with serve_app(build_app(engine, MODEL)) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        base = {"model": MODEL, "prompt": "hello there", "ignore_eos": True}
        unset = http.post("/v1/completions", json=base).json()
        assert unset["usage"]["completion_tokens"] == 4  # the override's max_new_tokens, not OpenAI's 16
        assert http.post("/v1/completions", json={**base, "max_tokens": 6}).json()["usage"]["completion_tokens"] == 6
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "ignore_eos": True,
                                                       "messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["usage"]["completion_tokens"] == 4
        # greedy from the file: the same text twice
        texts = {http.post("/v1/completions", json=base).json()["choices"][0]["text"] for _ in range(2)}
        assert len(texts) == 1
