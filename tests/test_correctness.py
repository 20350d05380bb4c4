"""Greedy output equals HF transformers token for token, for every architecture and scheduling mode."""
from __future__ import annotations

import pytest

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import CPUBackend
from tiny_models import hf_greedy, sample_prompts

MAX_TOKENS = 16
NATIVE = CPUBackend.supports(torch.device("cpu"), torch.float32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# name -> engine options; each mode must leave outputs unchanged
MODES = {
    "default": {},
    "token_budget_8": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 10},
    "decode_first": {"decode_first": True},
    "pack": {"prefill_admission_policy": "pack", "prefill_max_batch_size": 2},
    "one_seq": {"max_num_seqs": 1},
    "no_prefix_cache_no_chunking": {"enable_prefix_caching": False, "enable_chunked_prefill": False},
    "torch_backend": {"attention_backend": "torch"},  # F.linear and SDPA instead of the CPU backend's kernels
}


def _prompts(model_dir) -> list[list[int]]:
    prompts = sample_prompts(model_dir, 5, seed=3)
    system = sample_prompts(model_dir, 2, seed=11)[1][:40]  # a 40-token shared "system prompt"
    shared = [system + p[:7] for p in prompts[1:3]]
    return prompts + shared + [prompts[2]]  # shared prefixes and one exact repeat


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    prompts = _prompts(tiny_model_dir)
    refs = [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in prompts]
    assert any(len(set(r)) > 3 for r in refs), "degenerate reference"
    return prompts, refs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(tiny_model_dir, references, mode):
    prompts, refs = references
    llm = LLM(model=str(tiny_model_dir), **{"num_kv_blocks": 128, **MODES[mode]})
    # the CPU backend runs in every mode but torch_backend wherever its kernels can be built
    assert llm.engine.backend.name == ("cpu" if mode != "torch_backend" and NATIVE else "torch")
    # strings and id lists mixed in one call; a string is used only where it encodes back to the same ids
    texts = [llm.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    mixed = [t if i % 2 and llm.tokenizer.encode(t) == p else p for i, (t, p) in enumerate(zip(texts, prompts))]
    assert any(isinstance(m, str) for m in mixed)
    # two calls, so the second's shared prefix and exact repeat find the first's cached blocks
    outs = llm.generate(mixed[:6], GREEDY) + llm.generate(mixed[6:], GREEDY)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs in mode {mode}"
        assert out.finish_reason == "length"
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"
    if llm.engine.config.enable_prefix_caching:
        assert stats["prefix_cache_hits"] > 0, "shared prefixes should hit the cache"


def test_mlp_in_row_chunks_matches_hf(tiny_model_dir, references, monkeypatch):
    """On CPU a step's MLP runs MLP_CHUNK_ROWS rows at a time (platforms/cpu.py); at 8 rows every
    prefill here is split, the last piece short."""
    from roseinfer.platforms import cpu

    monkeypatch.setattr(cpu, "MLP_CHUNK_ROWS", 8)
    prompts, refs = references
    assert any(len(p) % 8 for p in prompts) and max(len(p) for p in prompts) > 16
    outs = LLM(model=str(tiny_model_dir), num_kv_blocks=128).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs


def test_logits_in_row_chunks_match_hf(tiny_model_dir, references, monkeypatch):
    """On CPU the LM head and the sampler run LOGITS_CHUNK_ROWS rows at a time (platforms/base.py);
    at 3 rows a step in which all 8 requests here sample splits into pieces of 3 / 3 / 2."""
    from roseinfer.platforms import base

    monkeypatch.setattr(base, "LOGITS_CHUNK_ROWS", 3)
    prompts, refs = references
    assert len(prompts) % 3
    outs = LLM(model=str(tiny_model_dir), num_kv_blocks=128).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs


def test_decode_layers_in_one_c_call_match_hf_and_the_layer_by_layer_path(tiny_model_dir, references, monkeypatch,
                                                                           packed_matmul_on_any_cpu):
    """Where every part of a Llama-style layer runs in C, a decode step runs all layers in one call
    (csrc/decode_layers.c): tokens equal HF's, and logprobs equal the layer-by-layer path's bit for
    bit. GPT-2 and Qwen3's q/k norms keep the layer-by-layer path."""
    from roseinfer.backends.cpu import ops
    from roseinfer.backends.cpu.llama import CPULlamaForCausalLM

    prompts, refs = references
    calls = []
    real_decode_layers = ops.decode_layers
    monkeypatch.setattr(ops, "decode_layers", lambda *args: calls.append(args[1].shape[0]) or real_decode_layers(*args))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    in_c = LLM(model=str(tiny_model_dir), num_kv_blocks=128).generate(prompts, params)
    assert [o.token_ids for o in in_c] == refs
    runner = LLM(model=str(tiny_model_dir), num_kv_blocks=128).engine.runner
    eligible = isinstance(runner.model, CPULlamaForCausalLM) and not runner.model.cfg.qk_norm
    if eligible and runner.model.decode_layers(runner.kv_caches) is None:
        pytest.skip("the packed matmul kernel does not run here (oneDNN does not pack 64-row blocks here)")
    assert (len(calls) > 0) == eligible and (not calls or max(calls) == len(prompts))
    monkeypatch.setattr(CPULlamaForCausalLM, "decode_layers", lambda self, kv_caches: None)
    layer_by_layer = LLM(model=str(tiny_model_dir), num_kv_blocks=128).generate(prompts, params)
    assert [o.logprobs for o in in_c] == [o.logprobs for o in layer_by_layer]
