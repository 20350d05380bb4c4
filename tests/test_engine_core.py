"""EngineCore.step's outputs are plain data (what could cross to another process as it is: no tensors,
no Request) and carry what the engine produced: HF's greedy tokens, logprobs, prompt logprobs, finish
reasons and timestamps, with and without speculative drafts."""
from __future__ import annotations

from typing import Any

import msgspec
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.sampling_params import SamplingParams
from tiny_models import hf_greedy, sample_prompts

MAX_TOKENS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
         "disable_by_batch_size": 8}


def assert_plain(value: Any, where: str = "output") -> None:
    if value is None or type(value) in (int, float, str, bool):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
    elif isinstance(value, msgspec.Struct):
        for f in msgspec.structs.fields(value):
            assert_plain(getattr(value, f.name), f"{where}.{f.name}")
    else:
        raise AssertionError(f"{where} is a {type(value).__name__}, not plain data")


def _run(engine: LLMEngine) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert_plain(out)
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutput) == out
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_step_outputs_are_plain_data_and_what_the_engine_produced(tiny_model_factory, speculative) -> None:
    model_dir = tiny_model_factory("llama")
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, speculative_config=speculative))
    p = sample_prompts(model_dir, 3, seed=11, max_len=40)
    prompts = [p[0][:3] * 6, p[1], p[2]]  # a cycle, whose continuation n-gram drafts tend to guess
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    ids = [engine.add_request(prompt, param) for prompt, param in zip(prompts, params)]
    outputs = _run(engine)
    for rid, prompt, param in zip(ids, prompts, params):
        outs = outputs[rid]
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + ["length"]
        assert all(o.num_prompt_tokens == len(prompt) for o in outs)
        first, final = outs[0], outs[-1]
        assert first.times is not None and final.times is not None
        assert first.times.arrival <= first.times.admitted <= first.times.first_token <= final.times.finished
        assert len(final.times.token_times) == MAX_TOKENS
        if param.logprobs is None:
            assert all(not o.new_logprobs for o in outs) and first.prompt_logprobs is None
        else:
            logprobs = [lp for o in outs for lp in o.new_logprobs]
            assert [lp.token_id for lp in logprobs] == [t for o in outs for t in o.new_token_ids]
            assert all(len(lp.top) == 2 for lp in logprobs)
            assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
            assert all(o.prompt_logprobs is None for o in outs[1:])
    if speculative is not None:
        assert engine.speculative_stats()["spec_num_accepted_tokens"] > 0
        assert any(len(o.new_token_ids) > 1 for o in outputs[ids[0]]), "no step emitted a verified draft"
    engine.pop_finished_ids()
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_abort_returns_the_final_output_as_plain_data(tiny_model_factory) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), num_kv_blocks=64))
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    final = engine.abort_request(rid)
    assert final is not None and final.finish_reason == "abort" and final.new_token_ids == []
    assert_plain(final)
    assert final.times is not None and len(final.times.token_times) == 1 and final.times.finished is not None
    assert engine.abort_request(rid) is None  # already finished
    assert engine.step() == [] and not engine.has_unfinished()
    assert engine.kv_cache_stats()["used_blocks"] == 0
