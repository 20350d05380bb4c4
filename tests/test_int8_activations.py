"""The 8-bit activation path (--cpu-activations int8, csrc/q8_activations.c): each weight type's
kernel against a reference that quantizes the rows of x the same way (Q8_K for Q4_K/Q6_K, Q8_0
for the 32-weight types) and multiplies the dequantized values in float64, in every build this CPU
can run; and a tiny model's next-token distributions against the exact path's."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from bench_helpers import benchmark_script
from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.quantized import INT8_ACTIVATIONS, INT8_TYPES, QuantizedLinear
from test_native_kernels import needs_kernels
from test_quant_kernel_builds import BUILDS, kernels_built_for
from test_quantized import K_QUANTS, QTYPES as ALL_QTYPES, _tiny_hf, random_blocks

agreement_module = benchmark_script("int8_agreement")

# Q5_K's integer kernel reads repacked tiles only (test_int8_gemm.py); MXFP4 keeps fp32 rows under int8
QTYPES = [q for q in ALL_QTYPES if q in INT8_TYPES and q != QT.Q5_K]


def quantized_blocks(x: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """x's rows quantized as the kernel does, per block of 256 (Q8_K, for K-quants) or 32 (Q8_0):
    (the integers q [blocks, block] as float32, the scales d [blocks] float32)."""
    block = 256 if qtype in K_QUANTS else 32
    blocks = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1)
    if qtype in K_QUANTS:  # -127 / the value largest in magnitude (the first of equals), capped at 127
        largest = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
        iscale = np.where(amax > 0, np.float32(-127) / np.where(amax > 0, largest, 1), 0).astype(np.float32)
    else:
        iscale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.minimum(np.rint(iscale[:, None] * blocks), 127)
    d = np.where(amax > 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return q, d


def quantized_rows(x: np.ndarray, qtype: QT) -> np.ndarray:
    """x's rows quantized as the kernel does and dequantized: d * q per block, fp32 arithmetic."""
    q, d = quantized_blocks(x, qtype)
    return (d[:, None].astype(np.float64) * q).reshape(x.shape)


def _check(qtype: QT, rows: int, blocks_per_row: int, seed: int) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    weights, dense = random_blocks(qtype, 37, block * blocks_per_row, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dense.shape[1], generator=generator)
    if blocks_per_row > 1:
        x[0, :block] = 0.0  # a block of zeros: scale 0
    bias = torch.randn(37, generator=generator)
    got = ops.quant_matmul(x, weights, int(qtype) | INT8_ACTIVATIONS, bias).double()
    xq = torch.from_numpy(quantized_rows(x.numpy(), qtype))
    expected = xq @ dense.double().T + bias.double()
    # the integer sums are exact: what is left is the fp32 rounding of a few operations a block
    bound = 1e-5 * (xq.abs() @ dense.double().abs().T) + 1e-6
    assert ((got - expected).abs() <= bound).all(), (got - expected).abs().max()
    exact = x.double() @ dense.double().T + bias.double()
    assert not ((exact - expected).abs() <= bound).all(), "the bound cannot tell int8 rows from fp32 ones"
    # rows of x a stride apart read the same
    wide = torch.randn(rows, dense.shape[1] + 32, generator=generator)
    wide[:, :dense.shape[1]] = x
    assert torch.equal(ops.quant_matmul(wide[:, :dense.shape[1]], weights, int(qtype) | INT8_ACTIVATIONS, bias),
                       got.float())


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 37])
def test_int8_matmul_equals_the_reference_on_the_same_quantized_rows(qtype: QT, rows: int) -> None:
    # 37 outputs: a partial tile; 1 or 3 blocks a row; rows: each group size, partial and whole groups
    for blocks_per_row in (1, 3):
        _check(qtype, rows, blocks_per_row, seed=rows + blocks_per_row)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_int8_matmul_in_every_build(build: str, kernel_builds: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in QTYPES:
            for rows in (1, 3, 6):
                _check(qtype, rows, 3, seed=rows)


# llama (an untied head) in each type: Q4_K and Q6_K take Q8_K rows, the 32-weight types Q8_0 rows
AGREEMENT_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@needs_kernels
@pytest.mark.parametrize("qtype", AGREEMENT_TYPES)
def test_int8_activations_agree_with_the_exact_path_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    qtype: str) -> None:
    """The same GGUF with fp32 and int8 activations: the next-token distributions after each prefix of
    a prompt (prefill) agree within a KL bound and mostly on the top token, where a kernel that
    mixed up a sub-block's scale or offset lands far outside both; and the int8 engine's decode
    steps (the one-call decoder stack) give what its prefill gives, which an fp32 matmul there would not."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    hidden = 256 if qtype in ("Q4_K", "Q6_K") else 64
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", hidden, len(tok), tie_word_embeddings=False),
                          tok, qtype)
    prompt = [int(t) for t in torch.randint(3, len(tok), (96,), generator=torch.Generator().manual_seed(1))]

    def check(llm: LLM, activations: str) -> None:
        types = {m.native_type for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)}
        assert types and all(bool(t & INT8_ACTIVATIONS) == (activations == "int8") for t in types)

    result = int8_against_exact(src, prompt, check)
    # measured: KL 0.002 (32-weight types) to 0.04 (Q6_K), top-1 0.875 to 0.98 on this model, whose weights
    # are scaled up; Q4_K's or Q6_K's sub-block scales shifted by one gave KL 9 and top-1 0.01
    assert result.mean_kl < 0.1 and result.top1 >= 0.8, result


def int8_against_exact(src: Path, prompt: list[int], check: Callable[[LLM, str], None]):
    """The agreement of the GGUF's next-token distributions after each prefix of `prompt` with int8
    activations against fp32 (`check` sees each LLM and its activations first), once int8 is shown to
    change something and the int8 engine's decode steps (the one-call decoder stack) to give each
    generated token's top logprobs as its prefill over prompt + output does."""
    logits = {}
    for activations in ("fp32", "int8"):
        llm = LLM(model=str(src), quantization="gguf", cpu_activations=activations, num_kv_blocks=32)
        check(llm, activations)
        logits[activations] = agreement_module.prompt_logits(llm, prompt)
    base = torch.log_softmax(logits["fp32"].double(), dim=1)
    int8_log_probs = torch.log_softmax(logits["int8"].double(), dim=1)
    assert (int8_log_probs - base).abs().max() > 2e-3, "int8 rows changed nothing: the bound tells nothing"
    out = llm.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    again = torch.log_softmax(agreement_module.prompt_logits(llm, prompt[:8] + out.token_ids).double(), dim=1)
    for step, entry in enumerate(out.logprobs):
        row = again[8 - 1 + step]
        for token, value in entry.top:
            assert abs(row[token].item() - value) < 2e-4, (step, token, row[token].item(), value)
    return agreement_module.agreement(base, logits["int8"])


def test_cpu_activations_takes_its_three_values_only() -> None:
    from roseinfer.config import EngineConfig

    assert EngineConfig().cpu_activations == "auto"
    with pytest.raises(ValueError, match="cpu_activations must be one of auto, fp32, int8"):
        EngineConfig(cpu_activations="int4")
