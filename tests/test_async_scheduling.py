"""Overlap scheduling (--async-scheduling on) forced on a CPU, through the same code path as on CUDA:
step N + 1 launched before step N's tokens are read, its placeholders filled from N's sampled ids
on the device. Outputs equal HF's greedy tokens and the synchronous engine's, in every scheduling
mode, and every block is free afterwards."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from tiny_models import hf_greedy, sample_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 8},
    "decode_first": {"decode_first": True},
    "torch_backend": {"attention_backend": "torch"},
}
ARCHS = ["llama", "qwen3", "gpt2"]


def _prompts(model_dir) -> list[list[int]]:
    prompts = sample_prompts(model_dir, 5, seed=3)
    return prompts + [prompts[0][:20] + prompts[1][:5]]  # a shared prefix


def _engine(model_dir, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 128, "async_scheduling": "on", **options}))


def _drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(tiny_model_factory, arch, mode):
    model_dir = tiny_model_factory(arch)
    prompts = _prompts(model_dir)
    llm = LLM(model=str(model_dir), **{"num_kv_blocks": 128, "async_scheduling": "on", **MODES[mode]})
    assert llm.engine.core.async_scheduling
    outs = llm.generate(prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS), f"prompt {i} differs in mode {mode}"
        assert out.finish_reason == "length"
    assert llm.kv_cache_stats()["used_blocks"] == 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"


def test_steps_overlap_and_mixed_batches_arrive(tiny_model_factory):
    """A request added while others decode joins a mixed batch; each step returns the step before's
    tokens, so the first step returns nothing, and no output carries a placeholder."""
    model_dir = tiny_model_factory("llama")
    prompts = _prompts(model_dir)
    engine = _engine(model_dir)
    engine.add_request(prompts[0], GREEDY, request_id="a")
    assert engine.step() == []  # launched, not read
    assert engine.core.in_flight is not None
    engine.step()
    engine.add_request(prompts[1], GREEDY, request_id="b")
    outputs = _drain(engine)
    assert engine.core.in_flight is None
    tokens = {"a": engine.get_generated_ids("a"), "b": engine.get_generated_ids("b")}
    assert tokens["a"] == hf_greedy(model_dir, prompts[0], MAX_TOKENS)
    assert tokens["b"] == hf_greedy(model_dir, prompts[1], MAX_TOKENS)
    assert all(t >= 0 for out in outputs for t in out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_stops_at_max_tokens(tiny_model_factory, max_tokens):
    """A request whose step N ends it emits nothing of step N + 1 (launched before N was read)."""
    model_dir = tiny_model_factory("llama")
    prompts = _prompts(model_dir)
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(prompt, params, request_id=str(i))
    outputs = _drain(engine)
    for i, prompt in enumerate(prompts[:3]):
        emitted = [t for out in outputs if out.request_id == str(i) for t in out.new_token_ids]
        assert emitted == hf_greedy(model_dir, prompt, max_tokens)
        assert engine.get_generated_ids(str(i)) == emitted
        assert [out.finish_reason for out in outputs if out.request_id == str(i)][-1] == "length"
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_stops_at_eos(tiny_model_factory):
    """A token of HF's greedy output made the stop id: the request ends on it, as without overlap."""
    model_dir = tiny_model_factory("llama")
    prompt = _prompts(model_dir)[2]
    ref = hf_greedy(model_dir, prompt, MAX_TOKENS)
    stop_at = 4
    engine = _engine(model_dir)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              stop_token_ids=[ref[stop_at]]), request_id="r")
    engine.add_request(_prompts(model_dir)[3], GREEDY, request_id="other")
    outputs = _drain(engine)
    first = ref.index(ref[stop_at])
    assert engine.get_generated_ids("r") == ref[:first + 1]
    assert [o.finish_reason for o in outputs if o.request_id == "r"][-1] == "stop"
    assert engine.get_generated_ids("other") == hf_greedy(model_dir, _prompts(model_dir)[3], MAX_TOKENS)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_abort_mid_flight(tiny_model_factory):
    """Aborted while its step is in flight: no token of that step comes out, its blocks are freed,
    and the others go on to HF's output."""
    model_dir = tiny_model_factory("llama")
    prompts = _prompts(model_dir)
    engine = _engine(model_dir)
    engine.add_request(prompts[0], GREEDY, request_id="gone")
    engine.add_request(prompts[1], GREEDY, request_id="kept")
    engine.step()
    engine.step()
    assert engine.core.in_flight is not None
    before = list(engine.get_generated_ids("gone"))
    final = engine.abort_request("gone")
    assert final is not None and final.finish_reason == "abort"
    outputs = _drain(engine)
    assert not [o for o in outputs if o.request_id == "gone"]
    assert engine.get_generated_ids("gone") == [t for t in before if t >= 0]
    assert engine.get_generated_ids("kept") == hf_greedy(model_dir, prompts[1], MAX_TOKENS)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_batches_that_need_host_ids_are_read_at_once(tiny_model_factory):
    """Penalties count the token ids: such a batch is read before the next is scheduled, and its
    output equals the synchronous engine's."""
    model_dir = tiny_model_factory("llama")
    prompts = _prompts(model_dir)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    results = {}
    for switch in ("on", "off"):
        engine = _engine(model_dir, async_scheduling=switch)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params if i else GREEDY, request_id=str(i))
        while engine.has_unfinished():
            engine.step()
            assert engine.core.in_flight is None
        results[switch] = [engine.get_generated_ids(str(i)) for i in range(len(prompts))]
    assert results["on"] == results["off"]


def test_auto_is_off_on_cpu_and_with_speculation(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    assert not _engine(model_dir, async_scheduling="auto").core.async_scheduling
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert not _engine(model_dir, speculative_config=spec).core.async_scheduling


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_beside_overlapped_decodes_equal_the_synchronous_engine(tiny_model_factory, pooling):
    """An embedding request's batch is read at once (its pooled rows depend on the tokens computed
    before it), while other requests decode around it; its vector is the synchronous engine's."""
    from roseinfer.engine.llm_engine import EMBEDDING_SAMPLING
    from roseinfer.pooling_params import PoolingParams

    model_dir = tiny_model_factory("llama")
    prompts = _prompts(model_dir)
    params = PoolingParams(pooling=pooling)
    vectors = {}
    for mode in ("on", "off"):
        engine = _engine(model_dir, async_scheduling=mode, max_num_batched_tokens=16)
        for i, prompt in enumerate(prompts[:3]):
            engine.core.add(engine.new_request(prompt, GREEDY, f"gen{i}"))
        engine.step()
        engine.core.add(engine.new_request(prompts[3], EMBEDDING_SAMPLING, "emb", pooling_params=params))
        finals = {o.request_id: o for o in _drain(engine) if o.finished}
        vectors[mode] = finals["emb"].embedding
        assert engine.kv_cache_stats()["used_blocks"] == 0
    assert vectors["on"] is not None and vectors["on"] == vectors["off"]
