"""Routed experts on the int8 path (--cpu-activations int8, backends/cpu/quantized_experts.py): a one-call
layer's Q4_K, Q5_K and Q6_K projections repacked at install for csrc/q8_gemm.c, and csrc/moe_experts.c's
one call multiplying rows quantized to Q8_K. Against the numpy reference that pins the dense int8
GEMM's numbers (test_int8_gemm.py) run on each expert's rows, and against the per-expert loop through
the dense int8 GEMM, bit for bit, in every build this CPU can run; another type keeps the exact
kernels beside a repacked one; and a tiny Qwen3-MoE GGUF's next-token distributions with int8
activations against the exact path's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from roseinfer import LLM
from roseinfer.backends.cpu import ops, quantized_experts
from roseinfer.backends.cpu.quantized import INT8_ACTIVATIONS, INT8_REPACKED
from roseinfer.backends.cpu.quantized_experts import OneCallQuantizedExperts, QuantizedExperts
from roseinfer.models.moe import StackedExperts, select_experts
from test_int8_activations import int8_against_exact
from test_int8_gemm import reference
from test_moe_gguf_blocks import EXPERTS, HIDDEN, _experts, _tiny_moe_hf, on_one_thread
from test_native_kernels import needs_kernels
from test_quant_kernel_builds import BUILDS, kernels_built_for

INT8 = INT8_ACTIVATIONS | INT8_REPACKED


def _int8_experts(gate_up: QT, down: QT, seed: int) -> tuple[OneCallQuantizedExperts, torch.Tensor, torch.Tensor]:
    """(experts installed with int8 activations, the gate/up and down blocks they were repacked from)."""
    blocks, _ = _experts(gate_up, down, seed=seed)
    gate_up_blocks, down_blocks = blocks.gate_up_proj.clone(), blocks.down_proj.clone()
    blocks.__class__ = StackedExperts
    quantized_experts.install(blocks, int8_activations=True)
    assert type(blocks) is OneCallQuantizedExperts
    return blocks, gate_up_blocks, down_blocks


def _pinned(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, gate_up_type: QT,
            down: torch.Tensor, down_type: QT) -> torch.Tensor:
    """Each routed expert's rows through the numpy reference of the int8 GEMM (SiLU * up by the backend's
    kernel between), each row times its weight in fp32, each token's rows summed from 0 in ascending
    expert order."""
    width = gate_up.shape[1] // 2
    zeros = {n: torch.zeros(n) for n in (2 * width, HIDDEN)}
    rows = {}
    for e in ids.unique().tolist():
        tokens = (ids == e).any(dim=1).nonzero()[:, 0]
        h = ops.silu_mul(reference(x[tokens], gate_up[e], gate_up_type, zeros[2 * width]))
        for token, row in zip(tokens.tolist(), reference(h, down[e], down_type, zeros[HIDDEN]).numpy()):
            rows[token, e] = row
    out = np.zeros((x.shape[0], HIDDEN), dtype=np.float32)
    for t in range(x.shape[0]):
        for slot in ids[t].argsort(stable=True).tolist():
            out[t] += rows[t, int(ids[t, slot])] * np.float32(weights[t, slot])
    return torch.from_numpy(out)


def _check(types: tuple[QT, QT], tokens: int, seed: int) -> None:
    experts, gate_up, down = _int8_experts(*types, seed=seed)
    assert experts.gate_up_proj.ggml_type == int(types[0]) | INT8 and experts.down_proj.ggml_type == int(types[1]) | INT8
    torch.manual_seed(seed)
    x = torch.randn(tokens, HIDDEN)
    weights, ids = select_experts(torch.randn(tokens, EXPERTS), 3, renormalize=False)
    got = experts.forward(x, weights, ids)
    assert torch.equal(got, _pinned(x, weights, ids, gate_up, types[0], down, types[1]))
    assert torch.equal(got, QuantizedExperts.forward(experts, x, weights, ids))


@needs_kernels
@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q6_K), (QT.Q6_K, QT.Q4_K), (QT.Q5_K, QT.Q6_K)],
                         ids=["Q4_K+Q6_K", "Q6_K+Q4_K", "Q5_K+Q6_K"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_int8_one_call_equals_the_pinned_reference_and_the_dense_gemm_per_expert(types: tuple[QT, QT],
                                                                                  tokens: int) -> None:
    """Random top-3 routing of 1, 7 and 40 tokens over 4 experts (1: a row an expert, slices of rows as
    work items; 7: partial groups of rows of x; 40: many rows an expert)."""
    _check(types, tokens, seed=tokens)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_int8_one_call_in_every_build(build: str, kernel_builds: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with kernels_built_for(build, kernel_builds, monkeypatch):
        _check((QT.Q4_K, QT.Q6_K), 5, seed=8)


@needs_kernels
def test_int8_one_call_with_whole_experts_as_items() -> None:
    """48 tokens of top-3 on one thread: each expert one work item, its down input quantized once a row."""
    experts, _, _ = _int8_experts(QT.Q4_K, QT.Q6_K, seed=6)
    torch.manual_seed(6)
    x = torch.randn(48, HIDDEN)
    weights, ids = select_experts(torch.randn(48, EXPERTS), 3, renormalize=True)
    assert torch.equal(on_one_thread(experts.forward, x, weights, ids), QuantizedExperts.forward(experts, x, weights, ids))


@needs_kernels
def test_a_type_the_gemm_does_not_take_keeps_the_exact_kernels_beside_a_repacked_one() -> None:
    """Q4_K gate/up with Q8_0 down: gate/up repacked, down left in its blocks with no int8 flag, the call
    equal to the loop that runs down through the exact kernel; int8 rows on blocks not repacked are
    refused rather than read as tiles."""
    experts, _, down = _int8_experts(QT.Q4_K, QT.Q8_0, seed=3)
    assert experts.gate_up_proj.ggml_type == int(QT.Q4_K) | INT8 and experts.down_proj.ggml_type == int(QT.Q8_0)
    assert torch.equal(experts.down_proj, down)
    torch.manual_seed(3)
    x = torch.randn(7, HIDDEN)
    weights, ids = select_experts(torch.randn(7, EXPERTS), 2, renormalize=True)
    assert torch.equal(experts.forward(x, weights, ids), QuantizedExperts.forward(experts, x, weights, ids))
    experts.down_proj.ggml_type = int(QT.Q8_0) | INT8_ACTIVATIONS
    with pytest.raises(ValueError, match="GGML types"):
        experts.forward(x, weights, ids)
    # the dense GEMM's repacked 32-block tiles take Q8_0 rows of x, the call Q8_K rows: refused, not misread
    experts.down_proj.ggml_type = int(QT.Q8_0) | INT8
    with pytest.raises(ValueError, match="GGML types"):
        experts.forward(x, weights, ids)


@needs_kernels
def test_int8_experts_agree_with_the_exact_path_on_a_tiny_moe_gguf(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE in Q4_K with fp32 and int8 activations: the routed experts take the int8 GEMM
    (their types say so), the next-token distributions after each prefix of a prompt agree within a KL
    bound and mostly on the top token, and the int8 engine's decode steps give what its prefill gives."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gguf(tmp_path / "moe.gguf", _tiny_moe_hf(), make_tiny_tokenizer(300), "Q4_K")
    prompt = [int(t) for t in torch.randint(3, 300, (96,), generator=torch.Generator().manual_seed(1))]

    def check(llm: LLM, activations: str) -> None:
        experts = llm.engine.runner.model.model.layers[1].mlp.experts
        assert type(experts) is OneCallQuantizedExperts
        assert bool(experts.gate_up_proj.ggml_type & INT8_REPACKED) == (activations == "int8")

    result = int8_against_exact(src, prompt, check)
    # measured: KL 0.013, top-1 0.92; each routed row given the Q8_K rows of another token: KL 3.2, top-1 0.11
    assert result.mean_kl < 0.1 and result.top1 >= 0.8, result
