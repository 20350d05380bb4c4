"""gpt-oss's MXFP4 experts kept in their blocks on the CPU backend: backends/cpu/quantized_experts.py's
per-expert path, each routed expert's gate/up and down through csrc/quant_matmul.c's MXFP4 kernel with
the biases and the clamped SwiGLU between them. The grouped compute against each token alone and
against the dequantized weights; the tiny gpt-oss GGUF with MXFP4 experts against HF holding the same
MXFP4 weights, in every scheduling mode the CPU backend runs, with no fp32 copy of its experts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from gguf_gpt_oss import gpt_oss_gguf_and_reference
from roseinfer import LLM
from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.quantized_experts import QuantizedExperts
from roseinfer.layers.activation import ClampedSwigluAndMul
from roseinfer.models.gpt_oss import select_top_logits
from test_correctness import GREEDY, MAX_TOKENS
from test_moe_gguf_blocks import CPU_MODES, EXPERTS, HIDDEN, _experts
from test_native_kernels import needs_kernels
from tiny_models import _trained_tokenizer, hf_greedy, sample_prompts

SWIGLU_LIMIT = 7.0


def _per_token(experts: QuantizedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token alone, its experts in ascending order: one row through the MXFP4 kernel for gate/up,
    its bias, the clamped SwiGLU, one row for down, its bias, times the routing weight."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in ids[t].argsort(stable=True).tolist():
            e = int(ids[t, slot])
            gate_up = ops.quant_matmul(x[t:t + 1], experts.gate_up_proj[e], int(QT.MXFP4), None)
            h = experts.act_and_mul.forward(gate_up + experts.gate_up_proj_bias[e])
            down = ops.quant_matmul(h, experts.down_proj[e], int(QT.MXFP4), None) + experts.down_proj_bias[e]
            out[t] += (down * weights[t, slot])[0]
    return out


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_mxfp4_experts_with_biases_and_the_clamp_equal_each_token_alone(tokens: int) -> None:
    """Top-2 of 4 experts over 1, 9 and 40 tokens (40: experts past the tiled kernel's rows); the clamp
    bites on these rows, and the biases change the output."""
    blocks, dense = _experts(QT.MXFP4, QT.MXFP4, seed=7, bias=True)
    blocks.act_and_mul = dense.act_and_mul = ClampedSwigluAndMul(alpha=1.702, limit=SWIGLU_LIMIT)
    assert type(blocks) is QuantizedExperts and blocks.gate_up_proj.dtype == torch.uint8
    torch.manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN) * 0.5
    weights, ids = select_top_logits(torch.randn(tokens, EXPERTS), 2)
    got = blocks.forward(x, weights, ids)
    alone = _per_token(blocks, x, weights, ids)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    want = dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    gate_up = ops.quant_matmul(x, blocks.gate_up_proj[int(ids[0, 0])], int(QT.MXFP4), None)
    assert (gate_up.abs() > SWIGLU_LIMIT).any()


@pytest.fixture(scope="module")
def gpt_oss_file(tiny_model_factory, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(the tiny gpt-oss as llama.cpp writes it, MXFP4 experts, its prompts, HF's greedy tokens on the
    MXFP4-rounded weights)."""
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    src, reference = gpt_oss_gguf_and_reference(tiny_model_factory("gpt_oss"), out, _trained_tokenizer())
    prompts = sample_prompts(reference, 3, seed=5)
    return src, prompts, [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]


@needs_kernels
@pytest.mark.parametrize("mode", list(CPU_MODES))
def test_gpt_oss_keeps_its_mxfp4_experts_and_matches_hf(gpt_oss_file, monkeypatch: pytest.MonkeyPatch,
                                                         mode: str) -> None:
    """Every layer's experts stay MXFP4 blocks, 17 bytes a 32 weights (17/128 of fp32's), and no fp32
    copy of them is held; greedy tokens are HF's, every KV block free after."""
    src, prompts, refs = gpt_oss_file
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(src.parent / "cache"))
    llm = LLM(model=str(src), quantization="gguf", **{"num_kv_blocks": 64, **CPU_MODES[mode]})
    cfg = llm.engine.model_config
    block, block_bytes = GGML_QUANT_SIZES[QT.MXFP4]
    for layer in llm.engine.runner.model.model.layers:
        experts = layer.mlp.experts
        assert type(experts) is QuantizedExperts
        for name, cols in (("gate_up_proj", cfg.hidden_size), ("down_proj", cfg.moe.expert_width)):
            weight = getattr(experts, name)
            assert weight.dtype == torch.uint8 and int(weight.ggml_type) == int(QT.MXFP4), name
            assert weight.shape[-1] == cols // block * block_bytes, name
        assert {p.dtype for n, p in experts.named_parameters() if not n.endswith("_bias")} == {torch.uint8}
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert llm.kv_cache_stats()["used_blocks"] == 0
