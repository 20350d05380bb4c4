"""The triton backend end to end: LLM(..., attention_backend="triton") gives HF's greedy tokens (fp32).
Without a GPU its kernels run on CPU tensors in Triton's interpreter (tests/triton_interpret.py)."""
from __future__ import annotations

import pytest

import triton_interpret

pytest.importorskip("triton")
triton_interpret.patch_interpreter()

from roseinfer import LLM, SamplingParams  # noqa: E402
from tiny_models import hf_greedy, sample_prompts  # noqa: E402

pytestmark = pytest.mark.triton
MAX_TOKENS = 8


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "llama_mqa", "phi3_longrope", "smollm3_yarn", "gemma2",
                                  "gemma3", "gemma4"])
def test_greedy_matches_hf_through_chunks_and_prefix_hits(tiny_model_factory, arch: str) -> None:
    """Prompts of assorted lengths in an 8-token budget (so prompts are prefilled in chunks, beside
    other sequences' decodes), then a shared prefix that hits the prefix cache."""
    model_dir = tiny_model_factory(arch)
    prompts = sample_prompts(model_dir, 3, seed=5)
    # shares full blocks with the longest prompt; past phi3_longrope's original context (48) as it is,
    # so both are rotated with the same factors (K/V rotated otherwise are never shared)
    donor = max(prompts, key=len)
    prompts.append(donor[:52] + [7, 8, 9])
    llm = LLM(model=str(model_dir), device=str(triton_interpret.device()), attention_backend="triton",
              num_kv_blocks=64, block_size=16, max_num_batched_tokens=8, dtype="float32")
    assert llm.engine.backend.name == "triton"
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts[:3], greedy, use_tqdm=False) + llm.generate(prompts[3:], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0 and stats["prefix_cache_hits"] > 0
