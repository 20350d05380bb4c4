"""The int8 path's repacked GEMM (csrc/q8_gemm.c, csrc/q8_gemm_blocks32.c) against a numpy reference that
pins its numbers: x quantized to Q8_K (Q8_0 for the 32-weight blocks) as the kernel quantizes it, each
block's integer sums exact (int64), and per output acc = fma(float32(I), d * dx, acc) (Q4_K then
acc = fma(float32(M), -(dmin * dx), acc), and so Q5_K; Q5_1 acc = fma(float32(S), m * dx, acc), S x's block sum)
block after block, an fp32 fused multiply-add emulated exactly, then + bias; bit for bit, in every
build this CPU can run, for partial tiles of 16 rows, every group size of rows of x and 1 or 3 blocks a
row; and a tied LM head's repacked copy beside the embedding's blocks."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from roseinfer import LLM
from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.quantized import INT8_ACTIVATIONS, INT8_REPACKED, QuantizedEmbedding, QuantizedLinear
from test_int8_activations import quantized_blocks
from test_layers import random_linear
from test_native_kernels import needs_kernels
from test_quant_kernel_builds import BUILDS, kernels_built_for
from test_quantized import _tiny_hf, random_blocks

TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q5_0, QT.Q5_1)
BLOCKS32 = (QT.Q8_0, QT.Q5_0, QT.Q5_1)
# where each type keeps its fp16 scales (d, then dmin or m)
SCALE_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q8_0: (0,), QT.Q5_0: (0,), QT.Q5_1: (0, 2)}


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """round_to_float32(a * b + c) for float32 arrays, rounded once: a * b is exact in float64, the sum's
    float64 rounding error is recovered exactly (two-sum), and a float32 tie that the float64 rounding
    made is broken towards the error's side."""
    product, addend = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    rounded = total.astype(np.float32)
    neighbour = np.nextafter(rounded, np.where(total > rounded, np.inf, -np.inf).astype(np.float32))
    tie = (total == (rounded.astype(np.float64) + neighbour.astype(np.float64)) / 2) & (error != 0)
    return np.where(tie, np.where(error > 0, np.maximum(rounded, neighbour), np.minimum(rounded, neighbour)), rounded)


def k_quant_parts(blocks: np.ndarray, qtype: QT) -> tuple[np.ndarray, ...]:
    """A K-quant weight's blocks [n, b, bytes] as integers: Q4_K and Q5_K (d, dmin, scales [n, b, 8],
    mins [n, b, 8], q [n, b, 256]); Q6_K (d, scales [n, b, 16], q - 32 [n, b, 256]); d and dmin float32."""
    if qtype in (QT.Q4_K, QT.Q5_K):
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        s = blocks[..., 4:16].astype(np.int64)
        scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], axis=-1)
        mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], axis=-1)
        nibbles = 48 if qtype == QT.Q5_K else 16
        qs = blocks[..., nibbles:nibbles + 128].reshape(*blocks.shape[:2], 4, 32).astype(np.int64)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(*blocks.shape[:2], 256)  # sub-block 2g + nibble
        if qtype == QT.Q5_K:  # value l of sub-block s: bit s of qh[l] is its fifth bit
            qh = blocks[..., 16:48].astype(np.int64)
            q |= (qh[..., None, :] >> np.arange(8)[:, None] & 1).reshape(*blocks.shape[:2], 256) << 4
        return d, dmin, scales, mins, q
    ql, qh = blocks[..., 0:128].astype(np.int64), blocks[..., 128:192].astype(np.int64)
    values = []
    for h in range(2):
        for t in range(4):
            low = ql[..., 64 * h + 32 * (t & 1):64 * h + 32 * (t & 1) + 32] >> (4 * (t >> 1)) & 15
            values.append(low | (qh[..., 32 * h:32 * h + 32] >> (2 * t) & 3) << 4)
    scales = blocks[..., 192:208].view(np.int8).astype(np.int64)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return d, scales, np.concatenate(values, axis=-1) - 32


def blocks32_parts(blocks: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A 32-block weight's blocks [n, b, bytes] as (d, m or None, q [n, b, 32]): Q8_0's signed q, Q5_0's
    5-bit value - 16, Q5_1's 5-bit value; d and m float32."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == QT.Q8_0:
        return d, None, blocks[..., 2:34].view(np.int8).astype(np.int64)
    start = 4 if qtype == QT.Q5_1 else 2
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == QT.Q5_1 else None
    qh = blocks[..., start:start + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
    qs = blocks[..., start + 4:start + 20].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (qh[..., None] >> np.arange(32) & 1) << 4
    return d, m, q - 16 if qtype == QT.Q5_0 else q


def reference32(x: torch.Tensor, weight: torch.Tensor, qtype: QT, bias: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n, nb = weight.shape[0], k // 32
    xq, dx = quantized_blocks(x.numpy(), qtype)
    xq, dx = xq.astype(np.int64).reshape(m, nb, 32), dx.reshape(m, nb)
    d, mins, q = blocks32_parts(weight.numpy().reshape(n, nb, -1), qtype)
    acc = np.zeros((m, n), dtype=np.float32)
    for b in range(nb):
        isum = np.einsum("nl,ml->mn", q[:, b], xq[:, b])
        acc = fma32(isum.astype(np.float32), d[None, :, b] * dx[:, b, None], acc)
        if mins is not None:
            sums = np.broadcast_to(xq[:, b].sum(axis=1)[:, None], (m, n))
            acc = fma32(sums.astype(np.float32), mins[None, :, b] * dx[:, b, None], acc)
    return torch.from_numpy(acc + bias.numpy()[None])


def reference(x: torch.Tensor, weight: torch.Tensor, qtype: QT, bias: torch.Tensor) -> torch.Tensor:
    if qtype in BLOCKS32:
        return reference32(x, weight, qtype, bias)
    m, k = x.shape
    n, nb = weight.shape[0], k // 256
    xq, dx = quantized_blocks(x.numpy(), qtype)
    xq, dx = xq.astype(np.int64).reshape(m, nb, 256), dx.reshape(m, nb)
    parts = k_quant_parts(weight.numpy().reshape(n, nb, -1), qtype)
    acc = np.zeros((m, n), dtype=np.float32)
    for b in range(nb):
        if qtype in (QT.Q4_K, QT.Q5_K):
            d, dmin, scales, mins, q = (p[:, b] for p in parts)
            dots = np.einsum("nsl,msl->mns", q.reshape(n, 8, 32), xq[:, b].reshape(m, 8, 32))
            isum = (dots * scales[None]).sum(axis=2)
            msum = (xq[:, b].reshape(m, 8, 32).sum(axis=2)[:, None, :] * mins[None]).sum(axis=2)
            acc = fma32(isum.astype(np.float32), d[None] * dx[:, b, None], acc)
            acc = fma32(msum.astype(np.float32), -(dmin[None] * dx[:, b, None]), acc)
        else:
            d, scales, q = (p[:, b] for p in parts)
            dots = np.einsum("nsl,msl->mns", q.reshape(n, 16, 16), xq[:, b].reshape(m, 16, 16))
            isum = (dots * scales[None]).sum(axis=2)
            acc = fma32(isum.astype(np.float32), d[None] * dx[:, b, None], acc)
    return torch.from_numpy(acc + bias.numpy()[None])


def raw_blocks(qtype: QT, rows: int, k: int, seed: int) -> torch.Tensor:
    """Every bit pattern of q's, scales and mins (random bytes; Q8_0's -128 too), with moderate fp16 d, dmin
    and m."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.001, 0.02, (rows, k // block)).astype(np.float16)
        data[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return torch.from_numpy(data.reshape(rows, -1))


def gemm(x: torch.Tensor, weight: torch.Tensor, qtype: QT, bias: torch.Tensor | None) -> torch.Tensor:
    packed = ops.repack_for_int8_gemm(weight, int(qtype), x.shape[1])
    return ops.weight_matmul(x, packed.data_ptr(), int(qtype) | INT8_ACTIVATIONS | INT8_REPACKED, weight.shape[0], bias)


def _check(qtype: QT, n: int, blocks_per_row: int, rows: int, seed: int) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    k = block * blocks_per_row
    generator = torch.Generator().manual_seed(seed)
    for weight in (random_blocks(qtype, n, k, seed=seed)[0], raw_blocks(qtype, n, k, seed)):
        x = torch.randn(rows, k, generator=generator)
        if blocks_per_row > 1:
            x[0, :block] = 0.0  # a block of zeros: scale 0
        bias = torch.randn(n, generator=generator)
        got = gemm(x, weight, qtype, bias)
        assert torch.equal(got, reference(x, weight, qtype, bias)), (got - reference(x, weight, qtype, bias)).abs().max()
        # each row of x alone gives what it gives in the batch; rows a stride apart read the same
        assert torch.equal(gemm(x[-1:], weight, qtype, bias), got[-1:])
        wide = torch.randn(rows, k + 32, generator=generator)
        wide[:, :k] = x
        assert torch.equal(gemm(wide[:, :k], weight, qtype, bias), got)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=[q.name for q in TYPES])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13])
def test_int8_gemm_equals_the_pinned_reference(qtype: QT, rows: int) -> None:
    # 37 outputs: two whole tiles of 16 and 5 rows of a third; 16: one whole tile; 5: one partial
    for n, blocks_per_row in ((37, 3), (16, 1), (5, 2)):
        _check(qtype, n, blocks_per_row, rows, seed=rows + n)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_int8_gemm_in_every_build(build: str, kernel_builds: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in TYPES:
            for rows in (1, 3, 6):
                _check(qtype, 37, 2, rows, seed=rows)


@needs_kernels
def test_repacking_rejects_what_the_gemm_does_not_take() -> None:
    weight = raw_blocks(QT.Q4_K, 4, 256, seed=0)
    for qtype in (QT.Q4_0, QT.Q4_1, QT.MXFP4):
        with pytest.raises(ValueError, match="not supported"):
            ops.repack_for_int8_gemm(weight, int(qtype), 256)
    with pytest.raises(ValueError, match="not supported"):
        ops.weight_matmul(torch.randn(1, 256), weight.data_ptr(), int(QT.Q4_K) | INT8_REPACKED, 4, None)


@needs_kernels
def test_a_tied_lm_head_runs_the_gemm_on_a_copy_and_the_embedding_keeps_its_blocks(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tied.gguf", _tiny_hf("llama", 256, len(tok), tie_word_embeddings=True), tok, "Q6_K")
    llm = LLM(model=str(src), quantization="gguf", cpu_activations="int8", num_kv_blocks=32)
    modules = list(llm.engine.runner.model.modules())
    embedding = next(m for m in modules if isinstance(m, QuantizedEmbedding))
    head = next(m for m in modules if isinstance(m, QuantizedLinear) and m.weight is embedding.weight)
    assert head.native_type == int(QT.Q6_K) | INT8_ACTIVATIONS | INT8_REPACKED
    assert head.native_weights == head.repacked_weight.data_ptr() != embedding.weight.data_ptr()
    x = torch.randn(3, 256)
    assert torch.equal(head(x), gemm(x, embedding.weight, QT.Q6_K, None))
    ids = torch.tensor([5, 7])
    dense = torch.from_numpy(gguf.quants.dequantize(embedding.weight.numpy(), QT.Q6_K))
    assert torch.equal(embedding(ids), dense[ids])


PARTS_CASES = {
    # Gemma-3's Q4_K_M q/k/v layout with a Q4_0 part, which keeps fp32 rows
    "q5_0,q5_0,q8_0,q4_0": (96, [(QT.Q5_0, 37), (QT.Q5_0, 5), (QT.Q8_0, 16), (QT.Q4_0, 3)]),
    # every part repacked, reading all three forms of x's rows (Q8_K with both sums, Q8_0) quantized once
    "q4_k,q6_k,q8_0,q4_k": (512, [(QT.Q4_K, 37), (QT.Q6_K, 5), (QT.Q8_0, 16), (QT.Q4_K, 19)]),
}


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("case", list(PARTS_CASES))
def test_a_weight_in_parts_runs_each_repacked_parts_gemm_into_its_columns(case: str, rows: int) -> None:
    """A fused q/k/v in parts: under int8 each part of a repacked type runs its GEMM into its columns, bit
    for bit as that part alone, a Q4_0 part keeps its fp32 rows; the weight becomes the parts' bytes back
    to back."""
    from roseinfer.backends.cpu.quantized import QuantizedPartsLinear, install
    from roseinfer.models.weights import BlockPart

    k, parts = PARTS_CASES[case]
    blocks = [raw_blocks(qtype, n, k, seed=i) if qtype != QT.Q4_0 else random_blocks(qtype, n, k, seed=i)[0]
              for i, (qtype, n) in enumerate(parts)]
    linear = random_linear(k, sum(n for _, n in parts), bias=True)
    flat = torch.cat([b.reshape(-1) for b in blocks])
    offsets = [0, *np.cumsum([b.numel() for b in blocks])]
    weight = nn.Parameter(flat, requires_grad=False)
    weight.block_parts = [BlockPart(int(q), n, int(o), b.numel()) for (q, n), o, b in zip(parts, offsets, blocks)]
    linear.weight = weight
    install(nn.Sequential(linear), int8_activations=True)
    assert isinstance(linear, QuantizedPartsLinear)
    assert [p.type for p in linear.weight_parts] == [
        int(q) | INT8_ACTIVATIONS | INT8_REPACKED if q != QT.Q4_0 else int(q) for q, _ in parts]
    x = torch.randn(rows, k)
    biases = linear.bias.split([n for _, n in parts])
    expected = [gemm(x, b, q, c) if q != QT.Q4_0 else ops.quant_matmul(x, b, int(q), c)
                for b, (q, _), c in zip(blocks, parts, biases)]
    assert torch.equal(linear(x), torch.cat(expected, dim=1))
