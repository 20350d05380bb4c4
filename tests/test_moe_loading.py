"""Mixtures of experts loaded other ways: from GGUF files written as llama.cpp's converter writes them
(experts stacked in 3-D `ffn_*_exps`, Mixtral as `llama` with q/k permuted, gpt-oss with MXFP4
experts), and over two
tensor-parallel ranks, each holding its share of every expert's width."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from roseinfer import LLM
from roseinfer.loader.gguf import convert_gguf
from roseinfer.models.config import ModelConfig
from gguf_writer import write_tiny_gguf
from test_correctness import GREEDY, MAX_TOKENS
from test_correctness import _prompts as correctness_prompts
from tiny_models import MOE_ARCHS, _trained_tokenizer, hf_greedy, load_hf_model, sample_prompts


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gguf_file_gives_hf_greedy_tokens(tiny_model_factory, tmp_path: Path, arch: str) -> None:
    """The file's config comes back as the checkpoint's (dense layers found by their missing router),
    and the engine on the file, on the CPU backend and on torch, gives HF's tokens."""
    model_dir = tiny_model_factory(arch)
    src = write_tiny_gguf(tmp_path / f"{arch}.gguf", load_hf_model(model_dir), _trained_tokenizer(), "F32")
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))
    converted = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    original = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    assert converted.moe == original.moe and converted.clip_qkv == original.clip_qkv
    prompts = sample_prompts(model_dir, 3, seed=5)
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    for backend in ("auto", "torch"):
        llm = LLM(model=str(src), attention_backend=backend, num_kv_blocks=64)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs, backend
        assert llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.parametrize("arch", [arch for arch in MOE_ARCHS if arch != "olmoe"])
def test_greedy_matches_hf_on_two_ranks(tiny_model_factory, arch: str) -> None:
    """Chunked prefill, prefix caching and preemption over two ranks: HF's tokens, every block free."""
    model_dir = tiny_model_factory(arch)
    prompts = correctness_prompts(model_dir)
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, num_kv_blocks=10, max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False) + llm.generate(prompts[6:], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == refs
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert llm.kv_cache_stats()["used_blocks"] == 0
        moe = llm.engine.model_config.moe  # rank 0 holds half of every expert's width
        experts = llm.engine.runner.model.model.layers[moe.sparse_layers[0]].mlp.experts
        assert experts.down_proj.shape == (moe.num_experts, llm.engine.model_config.hidden_size, moe.expert_width // 2)
    finally:
        llm.shutdown()


def test_olmoe_on_two_ranks_is_refused_with_the_reason(tiny_model_factory) -> None:
    """OLMoE's q/k norms span every head, which no rank holds alone."""
    with pytest.raises(ValueError, match="norm"):
        LLM(model=str(tiny_model_factory("olmoe")), tensor_parallel_size=2)


def test_a_gpt_oss_gguf_with_mxfp4_experts_gives_hf_greedy_tokens(tiny_model_factory, tmp_path: Path) -> None:
    """llama.cpp's `gpt-oss` file (experts split and in MXFP4, sinks, the router's bias) converts back
    into gpt-oss's config and weights: the engine on it gives the tokens of transformers holding the
    MXFP4-rounded experts. The clamp is llama.cpp's fixed 7.0, which the checkpoint here is given."""
    from gguf_gpt_oss import gpt_oss_gguf_and_reference

    src, source = gpt_oss_gguf_and_reference(tiny_model_factory("gpt_oss"), tmp_path, _trained_tokenizer())
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))
    converted = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    original = ModelConfig.from_dict(json.loads((source / "config.json").read_text()))
    for field in ("moe", "sliding_windows", "clamped_swiglu", "attention_sinks", "o_proj_bias", "head_dim"):
        assert getattr(converted, field) == getattr(original, field), field
    prompts = sample_prompts(source, 3, seed=5)
    refs = [hf_greedy(source, p, MAX_TOKENS) for p in prompts]
    llm = LLM(model=str(src), num_kv_blocks=64)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    assert llm.kv_cache_stats()["used_blocks"] == 0
