"""On a CUDA machine the engine gives the same greedy tokens as HF (fp32). Skips without CUDA."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams
from tiny_models import hf_greedy, sample_prompts


@pytest.mark.cuda
def test_cuda_greedy_matches_hf(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    prompts = sample_prompts(model_dir, 4, seed=2)
    llm = LLM(model=str(model_dir), device="cuda", num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in prompts]
    assert llm.kv_cache_stats()["used_blocks"] == 0
