"""DeepSeek-V2 / V3 loaded other ways: from GGUF files written as llama.cpp's converter writes its
`deepseek2` architecture (kv_b_proj split per head, experts stacked; loader/gguf_deepseek.py), and
over two tensor-parallel ranks (each its share of the heads and of every expert's width)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gguf_writer_deepseek import write_deepseek_gguf
from roseinfer import LLM
from roseinfer.loader.gguf import convert_gguf
from roseinfer.models.config import ModelConfig
from test_correctness import GREEDY, MAX_TOKENS
from test_correctness import _prompts as correctness_prompts
from tiny_models import _trained_tokenizer, hf_greedy, load_hf_model, sample_prompts

DEEPSEEK_ARCHS = ["deepseek_v2_lite", "deepseek_v3"]


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_deepseek2_gguf_file_gives_hf_greedy_tokens(tiny_model_factory, tmp_path: Path, arch: str) -> None:
    """The file's config comes back as the checkpoint's (latent ranks, routing, dense first layer,
    YaRN's mscale), and the engine on the F32 file, on the CPU backend and on torch, gives HF's tokens."""
    model_dir = tiny_model_factory(arch)
    src = write_deepseek_gguf(tmp_path / f"{arch}.gguf", load_hf_model(model_dir), _trained_tokenizer(), "F32")
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))
    converted = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    original = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    assert converted.mla == original.mla and converted.deepseek_moe == original.deepseek_moe
    assert converted.model_type == original.model_type
    prompts = sample_prompts(model_dir, 3, seed=5)
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    for backend in ("auto", "torch"):
        llm = LLM(model=str(src), attention_backend=backend, num_kv_blocks=64)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs, backend
        assert llm.kv_cache_stats()["used_blocks"] == 0


def test_deepseek2_experts_in_q8_0_blocks_give_the_dequantized_tokens(tiny_model_factory, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 file: on the CPU backend the stacked experts stay in their blocks (one C call a layer)
    and the engine gives the tokens it gives on the same file dequantized at load."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_model_factory("deepseek_v3")
    src = write_deepseek_gguf(tmp_path / "v3.gguf", load_hf_model(model_dir), _trained_tokenizer(), "Q8_0")
    prompts = sample_prompts(model_dir, 3, seed=6)
    blocks = LLM(model=str(src), quantization="gguf", num_kv_blocks=64)
    experts = blocks.engine.runner.model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "OneCallQuantizedExperts" and hasattr(experts.down_proj, "ggml_type")
    dense = LLM(model=str(src), quantization="none", num_kv_blocks=64)
    assert ([o.token_ids for o in blocks.generate(prompts, GREEDY, use_tqdm=False)]
            == [o.token_ids for o in dense.generate(prompts, GREEDY, use_tqdm=False)])


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_greedy_matches_hf_on_two_ranks(tiny_model_factory, arch: str) -> None:
    """Chunked prefill, prefix caching and preemption over two ranks: HF's tokens, every block free;
    rank 0 holds half the heads and half of every expert's width, the latent's projection whole."""
    model_dir = tiny_model_factory(arch)
    prompts = correctness_prompts(model_dir)
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, num_kv_blocks=10, max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False) + llm.generate(prompts[6:], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == refs
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert llm.kv_cache_stats()["used_blocks"] == 0
        cfg = llm.engine.model_config
        layer = llm.engine.runner.model.model.layers[cfg.deepseek_moe.first_moe_layer]
        assert layer.self_attn.num_heads == cfg.num_heads // 2
        assert layer.self_attn.kv_a_proj_with_mqa.out_features == cfg.mla.cache_width
        assert layer.mlp.experts.down_proj.shape[-1] == cfg.deepseek_moe.expert_size // 2
    finally:
        llm.shutdown()
