"""The GGUF-block matmul's kernels against gguf-py's dequantize and a torch matmul, in every build this
CPU can run: native, AVX2 only and portable. K-quants below 8 rows take csrc/kquant.c on AVX-512
(on AVX2 one row, and two of Q4_K; quant_matmul.c's generic kernel otherwise): one and two rows (four
FMA chains, or AVX2's one-row sums), partial and full groups of 4, several groups; from 8 rows
csrc/quant_tiled_matmul.c: 8, 13, 14, 17, 37 and 70 rows leave partial passes of rows of x, and 37
outputs a partial tile and pass; 300 rows go panel by panel, 1100 in chunks of rows; on AVX-512,
Q4_K up to 64 rows and Q6_K up to 32 take the pipelined tiles (csrc/kquant_pipelined_tiles.c). The
other types at 1 row (the generic kernel), then at 14, 16, 37, 70 and 300 (the tiles); 1 or 3 blocks
a row. Wherever the tiles run they sum as the packed fp32 kernel does on the dequantized weights,
bit for bit, also panel by panel over bands of tiles."""
from __future__ import annotations

import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from roseinfer.backends.cpu import kernels, ops
from test_native_kernels import needs_kernels
from test_quantized import K_QUANTS, QTYPES, random_blocks

X86 = platform.machine() in ("x86_64", "AMD64")
BUILDS = ("native", "avx2", "portable")


def _flags(build: str) -> tuple[str, ...]:
    # what an AVX2-only CPU builds, on this one; on a CPU without AVX-512, -march=native has no
    # AVX-512 to turn off, so the native build is that build (and is not compiled twice)
    if build == "avx2" and " avx512f" in kernels.cpu_flags():
        return kernels.CFLAGS + ("-mno-avx512f",)
    if build == "portable":
        return tuple(f for f in kernels.CFLAGS if f != "-march=native") + ("-mno-avx", "-mno-f16c", "-mno-fma")
    return kernels.CFLAGS


@contextmanager
def kernels_built_for(build: str, kernel_builds: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels compiled for `build` (skipped where this CPU cannot run it) into the session's
    kernel_builds folder, for the with-block; the real build is loaded again after it. The native
    build is the one the session's cache already holds."""
    if build != "native" and not X86:
        pytest.skip("the -mno-* flags are x86's")
    if build == "avx2" and " avx2" not in kernels.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    flags = _flags(build)
    if flags == kernels.CFLAGS:
        yield
        return
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "CFLAGS", flags)
        patch.setenv("ROSEINFER_CACHE_DIR", str(kernel_builds))
        kernels.native_library.cache_clear()
        try:
            yield
        finally:
            kernels.native_library.cache_clear()
    # the real build again, now, from the session's cache: loaded lazily, it would be compiled
    # afresh into whatever cache folder the next test to use it points at
    kernels.native_library()


def _packed_matmul(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ dense.T + bias by csrc/packed_matmul.c, dense packed in its layout: 64-row blocks, each
    column's 64 values side by side (held here while the kernel reads it)."""
    n, k = dense.shape
    padded = torch.nn.functional.pad(dense, (0, 0, 0, -n % 64))
    packed = padded.view(-1, 64, k).transpose(1, 2).contiguous()
    return ops.packed_matmul(x, packed.data_ptr(), n, bias)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_quant_matmul_equals_dequantize_then_matmul_in_every_build(build: str, kernel_builds: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in QTYPES:
            for blocks_per_row in (1, 3):
                blocks, dense = random_blocks(qtype, 37, gguf.GGML_QUANT_SIZES[qtype][0] * blocks_per_row,
                                              seed=blocks_per_row)
                bias = torch.randn(37)
                tiled_from = 8 if qtype in K_QUANTS else 14
                for rows in (1, 2, 3, 7, 8, 13, 14, 17, 37, 70, 300) if qtype in K_QUANTS else (1, 14, 16, 37, 70, 300):
                    x = torch.randn(rows, dense.shape[1])
                    got = ops.quant_matmul(x, blocks, int(qtype), bias)
                    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5,
                                               atol=1e-4 * dense.abs().max().item())
                    wide = torch.randn(rows, dense.shape[1] + 16)  # rows of x a stride apart
                    wide[:, :dense.shape[1]] = x
                    assert torch.equal(ops.quant_matmul(wide[:, :dense.shape[1]], blocks, int(qtype), bias), got)
                    if rows >= tiled_from:  # the tiles
                        assert torch.equal(got, _packed_matmul(x, dense, bias)), rows


@needs_kernels
@pytest.mark.usefixtures("restore_torch_threads")
@pytest.mark.parametrize("build", BUILDS)
def test_tiles_panel_by_panel_over_bands_and_chunks_sum_as_the_packed_kernel(build: str, kernel_builds: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """512 rows of x and 2200 outputs: the tiles' running sums (46 tiles of 48 rows) outgrow one
    band's 4 MB, so two bands of tiles take the panels in turn, the last tile partial. 1100 rows go in
    three chunks of 368, 368 and 364 rows, W decoded again for each. On 1 and 3 threads."""
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in (QT.Q4_K, QT.Q8_0):
            for rows, outputs in ((512, 2200), (1100, 150)):
                blocks, dense = random_blocks(qtype, outputs, 512, seed=3)
                x, bias = torch.randn(rows, 512), torch.randn(outputs)
                for threads in (1, 3):
                    torch.set_num_threads(threads)  # the kernels' calls pass torch's count on
                    got = ops.quant_matmul(x, blocks, int(qtype), bias)
                    expected = _packed_matmul(x, dense, bias)
                    assert torch.equal(got, expected), (qtype, rows, threads)


@needs_kernels
@pytest.mark.usefixtures("restore_torch_threads")
@pytest.mark.parametrize("build", BUILDS)
def test_pipelined_tiles_sum_as_the_packed_kernel(build: str, kernel_builds: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K and Q6_K at 8 to 64 rows of x (on AVX-512, csrc/kquant_pipelined_tiles.c: 1 to 4 vectors of
    x^T times tiles of 24 / 12 / 8 / 6 rows of W; Q6_K from 3 vectors takes the tiles as they were):
    150 outputs leave the last tile partial at every shape; on 1 and 3 threads a thread decodes its
    next tile's first panel while it multiplies the last of the one before; 3 blocks a row are 6
    panels of 128 columns."""
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in (QT.Q4_K, QT.Q6_K):
            blocks, dense = random_blocks(qtype, 150, 768, seed=5)
            bias = torch.randn(150)
            for threads in (1, 3):
                for rows in (8, 13, 16, 24, 40, 64):
                    x = torch.randn(rows, 768)
                    torch.set_num_threads(threads)  # the kernels' calls pass torch's count on
                    got = ops.quant_matmul(x, blocks, int(qtype), bias)
                    assert torch.equal(got, _packed_matmul(x, dense, bias)), (qtype, rows)


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_row_lookup_is_gguf_py_bit_for_bit_in_every_build(build: str, kernel_builds: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable build (no AVX, AVX2, F16C or FMA: the GCC-vector and scalar-fp16 code any compiler
    builds) included."""
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for qtype in QTYPES:
            blocks, dense = random_blocks(qtype, 19, gguf.GGML_QUANT_SIZES[qtype][0] * 2, seed=2)
            ids = torch.tensor([18, 0, 7])
            assert torch.equal(ops.dequantize_rows(blocks, int(qtype), ids, dense.shape[1]), dense[ids])


def _mxfp4_as_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [n, 17 B] rewritten as Q8_0 blocks [n, 34 B] of the same weights: d = 2^(e - 128)
    as an fp16 (exact while e stays within fp16's exponents), q the E2M1 codes' doubled values."""
    raw = blocks.numpy().reshape(blocks.shape[0], -1, 17)
    assert (raw[..., 0] >= 104).all() and (raw[..., 0] <= 143).all(), "a scale fp16 cannot hold"
    scales = np.ldexp(1.0, raw[..., 0].astype(np.int32) - 128).astype(np.float16)
    codes = np.concatenate([raw[..., 1:] & 15, raw[..., 1:] >> 4], axis=-1)
    ints = np.array(gguf.quants.MXFP4.kvalues, dtype=np.int8)[codes]
    q8 = np.concatenate([scales[..., None].view(np.uint8), ints.view(np.uint8)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(q8.reshape(blocks.shape[0], -1)))


@needs_kernels
@pytest.mark.parametrize("build", BUILDS)
def test_mxfp4_sums_as_q8_0_on_the_same_weights_bit_for_bit_in_every_build(build: str, kernel_builds: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP4's weights are integers times a power of two, so its kernels (the one-row path's block
    scale taken out of the sum, the row groups, the tiles) give Q8_0's bits on the same real weights:
    1, 3 and 7 blocks a row, 37 outputs (a partial tile), 1 to 70 rows of x."""
    with kernels_built_for(build, kernel_builds, monkeypatch):
        for blocks_per_row in (1, 3, 7):
            blocks, dense = random_blocks(QT.MXFP4, 37, 32 * blocks_per_row, seed=blocks_per_row)
            as_q8_0 = _mxfp4_as_q8_0(blocks)
            assert torch.equal(ops.dequantize_rows(as_q8_0, int(QT.Q8_0), torch.arange(37), dense.shape[1]), dense)
            bias = torch.randn(37)
            for rows in (1, 2, 3, 8, 13, 17, 37, 70):
                x = torch.randn(rows, dense.shape[1])
                got = ops.quant_matmul(x, blocks, int(QT.MXFP4), bias)
                assert torch.equal(got, ops.quant_matmul(x, as_q8_0, int(QT.Q8_0), bias)), (blocks_per_row, rows)
