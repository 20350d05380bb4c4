"""On a CUDA machine (the triton backend, CUDA graphs on by default): HF's greedy tokens in fp32 for
every architecture, graphs and eager alike, bf16 against HF bf16 where the first token is clear,
and seeded sampling the same alone or in a batch. Skips without CUDA."""
from __future__ import annotations

import pytest
import torch

from roseinfer import LLM, SamplingParams
from tiny_models import ARCHS, hf_greedy, sample_prompts

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_greedy_matches_hf(tiny_model_factory, arch: str, enforce_eager: bool) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = sample_prompts(model_dir, 6, seed=2)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=8,
              enforce_eager=enforce_eager)
    assert llm.engine.backend.name == "triton"
    assert (llm.engine.backend.graphs is None) == enforce_eager
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in prompts]
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_cuda_graph_replays_give_the_eager_tokens_at_every_bucket(tiny_model_factory) -> None:
    """Batches of 1..20 decoding sequences land on buckets 1, 2, 4, 8, 16 and 20, padded."""
    model_dir = tiny_model_factory("llama")
    prompts = sample_prompts(model_dir, 20, seed=4)
    runs = {}
    for eager in (False, True):
        llm = LLM(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=20,
                  enforce_eager=eager)
        runs[eager] = [[o.token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)]
                       for n in (1, 3, 7, 13, 20)]
    assert runs[False] == runs[True]


def test_bf16_first_tokens_match_hf_bf16_where_they_are_clear(tiny_model_factory) -> None:
    """bf16 rounds differently in every kernel, so only first tokens whose top two logits (HF bf16)
    stand apart are compared."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    prompts = sample_prompts(model_dir, 12, seed=6)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    clear, expected = [], []
    with torch.inference_mode():
        for p in prompts:
            logits = hf(torch.tensor([p], device="cuda")).logits[0, -1].float()
            top = logits.topk(2)
            if top.values[0] - top.values[1] > 0.25:
                clear.append(p)
                expected.append(int(top.indices[0]))
    assert len(clear) >= 3, "too few prompts with a clear first token"
    llm = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=64)
    outs = llm.generate(clear, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids[0] for o in outs] == expected


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama")
    prompts = sample_prompts(model_dir, 5, seed=8)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=128)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=10, seed=1234, ignore_eos=True,
                            repetition_penalty=1.1)
    alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate(prompts, [others, others, seeded, others, others], use_tqdm=False)
    assert batch[2].token_ids == alone
