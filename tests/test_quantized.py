"""GGUF weights kept quantized (--quantization gguf): the CPU backend's block matmul and row lookup
(csrc/quant_matmul.c) against gguf-py's dequantize and a torch matmul, and whole models against HF
running the dequantized weights."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from gguf_writer import encode_weights
from roseinfer.backends.cpu import ops

QTYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K]
needs_kernels = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                   reason="no C compiler: the native kernels cannot be built")


def random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [rows, bytes per row], the same weights dequantized by gguf-py [rows, cols])."""
    rng = np.random.default_rng(seed)
    raw, stored = encode_weights(rng.standard_normal((rows, cols)).astype(np.float32), qtype, rng)
    assert stored == qtype
    dense = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(dense)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
@pytest.mark.parametrize("rows", [1, 3, 8, 21])
def test_quant_matmul_equals_dequantize_then_matmul(qtype: QT, rows: int) -> None:
    # 37 outputs: a partial tile; 2 blocks of 256 (K-quants) or 24 of 32 per row: widths that are
    # whole blocks, and for the 32-blocks (768 = 3 * 256) not whole 256-wide steps
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 24 * block
    blocks, dense = random_blocks(qtype, 37, cols)
    x = torch.randn(rows, cols)
    bias = torch.randn(37)
    got = ops.quant_matmul(x, blocks, int(qtype), bias)
    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5, atol=1e-4 * dense.abs().max().item())
    # strided rows of x (a slice of a wider tensor) read the same
    wide = torch.randn(rows, cols + 16)
    wide[:, :cols] = x
    torch.testing.assert_close(ops.quant_matmul(wide[:, :cols], blocks, int(qtype), bias), got)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_dequantize_rows_equals_gguf_dequantize_bit_for_bit(qtype: QT) -> None:
    blocks, dense = random_blocks(qtype, 9, gguf.GGML_QUANT_SIZES[qtype][0] * 3, seed=1)
    ids = torch.tensor([8, 0, 3, 3])
    assert torch.equal(ops.dequantize_rows(blocks, int(qtype), ids, dense.shape[1]), dense[ids])


@needs_kernels
def test_quant_matmul_refuses_types_and_widths_it_does_not_handle() -> None:
    blocks, _ = random_blocks(QT.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="not supported"):
        ops.quant_matmul(torch.randn(2, 32), blocks[:, :18], int(QT.Q4_K), None)  # 32 is not whole 256-blocks
    with pytest.raises(ValueError, match="not supported"):
        ops.quant_matmul(torch.randn(2, 32), blocks[:, :18], int(QT.Q5_0), None)
