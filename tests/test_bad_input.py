"""Bad input gets a clear ValueError and leaves the LLM usable and leak-free."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=64)


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([5] * 300, SamplingParams(max_tokens=4), "context length"),
    ([5] * 250, SamplingParams(max_tokens=20), "context length"),
    ([10_000], SamplingParams(), "token ids"),
    ([5], SamplingParams(logit_bias={99_999: 1.0}), "logit_bias"),
])
def test_bad_requests_raise_value_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert llm.kv_cache_stats()["used_blocks"] == 0
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"logit_bias": {5: float("-inf")}}, "logit_bias values must be finite"),
    ({"seed": 2**64}, "seed must be >= -9223372036854775808 and <= 18446744073709551615"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"top_k": True}, "top_k must be an integer"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_temperature_below_epsilon_is_greedy(llm):
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-4).greedy
    prompt = [[5, 6, 7]]
    tiny = llm.generate(prompt, SamplingParams(temperature=1e-9, max_tokens=6, ignore_eos=True))[0].token_ids
    assert tiny == llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].token_ids


def test_a_request_that_can_never_fit_the_pool_is_rejected(tiny_model_factory):
    small = LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10))
    assert small.kv_cache_stats()["used_blocks"] == 0


def test_unknown_model_type(tmp_path, tiny_model_factory):
    import json
    import shutil

    folder = tmp_path / "weird"
    shutil.copytree(tiny_model_factory("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "falcon"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported: gpt2, llama"):
        LLM(model=str(folder))


def test_missing_model_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="no such file or folder"):
        LLM(model=str(tmp_path / "nope" / "model.gguf"))


def test_unreachable_hub_id_is_one_clear_line(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Name or service not known\nlong traceback text")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError) as info:
        LLM(model="SomeOrg/some-model")
    message = str(info.value)
    assert "SomeOrg/some-model" in message and "local folder" in message and "\n" not in message


def test_a_bad_prompt_after_good_ones_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[5, 6, 7], [8, 9], []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()
    assert llm.kv_cache_stats()["used_blocks"] == 0
