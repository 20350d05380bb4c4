"""Linear layers whose weights are prepacked for oneDNN on CPU.

F.linear on CPU goes to MKL's sgemm, which repacks the weight matrix on every call and, on the
AMD (AVX-512) machines this was measured on, runs its AVX2 path. oneDNN with the weight reordered
once into its blocked layout ran the default model's matmuls 1.2-2.9x faster (fp32, 2 threads):
the LM head at 16 sequences in 6.7 ms against 19.4 ms, the MLP's gate/up at 64 in 1.07 against
1.42 ms, a 2048-token prefill's gate/up in 35 against 43 ms. Results differ from F.linear only by
summation order (~1e-4 absolute on outputs of magnitude ~10).

`prepack_linears` runs once after the weights are loaded; layers it cannot pack (CUDA, half
precision, a torch built without oneDNN) keep F.linear. The floor (bench/floor.py) calls these same
layers, so it always measures the matmuls the engine runs.

oneDNN builds (and JIT-compiles) one primitive per input shape and caches it, in its own cache and in
ideep's, for the life of the process: ~0.6 MB per (layer shape, row count). A server sees every row
count from 1 to max_num_batched_tokens, so resident memory grew by ~2.6 MB per new row count over
four of the model's five matmul shapes (256 row counts: +676 MiB); capping the caches instead
churned the allocator and grew further. So the rows are padded up to one of four sizes per octave
(`padded_rows`): 48 sizes up to 8192 rows, at most 25 % padded rows, and none
for row counts that are already a size (1-8, 16, 64, 256, 2048, ...).

Decode batches go elsewhere. With few rows a matmul streams the weights, and oneDNN ran the default
model's at ~18 GB/s with one row. Where its packed layout is 64-row blocks (verified when packing;
on AVX-512 machines it is), the CPU has AVX-512 and the C kernels are on, up to
PACKED_MATMUL_MAX_ROWS rows go to csrc/packed_matmul.c, which reads the same packed copy. Over all
121 matmuls of the default model (2 threads, alternating, ms): 1 row 19-21 against oneDNN's 30-33, 8
rows 20-23 against 28-37, 16 rows 30-33 against 34-35, 64 rows 91-95 against 96-105, 256 rows
363-392 against 385-441, 512 rows 699-830 against 688-905 and 2048 rows 2749-3148 against 2808-2980.
On those rows `forward_normed` and `forward_activated` also compute the layer's input from the
previous op's output (RMSNorm, SiLU * up) in the same C call: a decoder layer makes 3 Python-to-C
crossings fewer per step.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers import native

if TYPE_CHECKING:
    from roseinfer.layers.activation import ActivationAndMul
    from roseinfer.layers.norm import RMSNorm

# Rows per MLP pass on CPU. A prefill step's widest tensors are the MLP's intermediates (gate|up is
# [rows, 2 x intermediate]: 25 MB of the default model's 2048-token step, 38 MB with SiLU's output),
# and the allocator (glibc, jemalloc and tcmalloc alike) keeps what a step touched, so they set the
# process's resident size for the rest of its life. In 512-row pieces a batch-64 run peaked 32 MiB
# lower (1863 against 1895 MiB) with prefill unchanged (833 against 829 prompt tok/s for 64 x 32,
# 834 against 825 for 64 x 256).
MLP_CHUNK_ROWS = 512


# Row-block sizes oneDNN uses for fp32 weights across ISAs; 1 is plain row-major order.
ROW_BLOCK_CANDIDATES = (64, 32, 16, 8, 4, 1)
_VERIFY_BLOCKS = 64  # row blocks compared at a time while verifying a layout: no second full copy


class Linear(nn.Linear):
    """nn.Linear that switches to a prepacked oneDNN weight once `prepack` has run."""

    packed: torch.Tensor | None = None
    packed_block: int | None = None  # B where `packed` is the weight's rows in blocks of B (`packed_rows_view`)
    native_weights: int | None = None  # the packed buffer's address once few rows go to the C kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]  # x is [rows, in_features] in every model here
        if self.takes_native_rows(rows):
            return native.packed_matmul(x, self.native_weights, self.out_features, self.bias)
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on norm(x), x first added into the residual stream where there is one (the
        stream starts at x where there is none); returns (output, stream). Where both run in C, the
        norm is the matmul's prologue: one call, the same results."""
        if norm.native and self.takes_native_rows(x.shape[0]):
            out = native.rms_norm_packed_matmul(x, norm.weight, norm.eps, residual, self.native_weights,
                                                self.out_features, self.bias)
            return out, x if residual is None else residual
        h, stream = norm.add_and_norm(x, residual)
        return self.forward(h), stream

    def forward_activated(self, gate_up: torch.Tensor, act: ActivationAndMul) -> torch.Tensor:
        """This layer on act(gate) * up; one C call where both run in C."""
        if act.native and self.takes_native_rows(gate_up.shape[0]):
            return native.silu_mul_packed_matmul(gate_up, self.native_weights, self.out_features, self.bias)
        return self.forward(act.forward(gate_up))

    def takes_native_rows(self, rows: int) -> bool:
        """Whether a matmul of `rows` rows runs in csrc/packed_matmul.c (`use_native`)."""
        return self.native_weights is not None and 0 < rows <= native.PACKED_MATMUL_MAX_ROWS

    def prepack(self) -> None:
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.packed_block = packed_row_block(self.packed, weight)
        # The packed copy replaces the dense one, which nothing reads any more; a weight shared
        # with an embedding (tied LM head) stays alive through the embedding until the embedding
        # reads its rows from this packed copy instead (layers/embedding.py).
        self.weight = None

    def use_native(self) -> None:
        """Up to PACKED_MATMUL_MAX_ROWS rows through csrc/packed_matmul.c, where the packed layout is
        the one it reads."""
        if (self.packed is not None and self.packed_block == native.PACKED_MATMUL_BLOCK
                and native.packed_matmul_suits_cpu()):
            self.native_weights = torch.ops.mkldnn.data_ptr(self.packed)

    def weight_bytes(self) -> int:
        tensor = self.packed if self.packed is not None else self.weight
        return tensor.numel() * tensor.element_size()


def packed_rows_view(packed: torch.Tensor, num_rows: int, dim: int, block: int) -> torch.Tensor | None:
    """A [ceil(num_rows / block), dim, block] float view of a packed weight's buffer, read as rows in
    blocks of `block` with each column's values side by side: element (r, c) at
    ((r // block) * dim + c) * block + r % block. None where the buffer's size does not fit that."""
    if packed.layout != torch._mkldnn or packed.dtype != torch.float32:
        return None
    floats = torch.ops.mkldnn._nbytes(packed) // 4
    blocks = -(-num_rows // block)
    if blocks * dim * block != floats:
        return None
    buffer = torch.frombuffer((ctypes.c_float * floats).from_address(torch.ops.mkldnn.data_ptr(packed)),
                              dtype=torch.float32)
    return buffer.view(blocks, dim, block)


def packed_row_block(packed: torch.Tensor, dense: torch.Tensor) -> int | None:
    """The block size B of `packed_rows_view` that reproduces every row of `dense` [rows, dim], or
    None. oneDNN picks its layout by CPU and version, so it is checked, never assumed."""
    for block in ROW_BLOCK_CANDIDATES:
        view = packed_rows_view(packed, dense.shape[0], dense.shape[1], block)
        if view is not None and _same_rows(view, dense):
            return block
    return None


@torch.no_grad()
def _same_rows(view: torch.Tensor, dense: torch.Tensor) -> bool:
    block, rows = view.shape[2], dense.shape[0]
    full = rows // block
    for start in range(0, full, _VERIFY_BLOCKS):
        stop = min(start + _VERIFY_BLOCKS, full)
        expected = dense[start * block:stop * block].reshape(stop - start, block, -1).transpose(1, 2)
        if not torch.equal(view[start:stop], expected):
            return False
    return rows % block == 0 or torch.equal(view[full, :, :rows % block], dense[full * block:].t())


def padded_rows(rows: int) -> int:
    """rows rounded up to the next of four sizes per octave above 8: 8, 10, 12, 14, 16, 20, 24, ..."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)  # a quarter of the largest power of two <= rows
    return -(-rows // step) * step


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


@torch.inference_mode()
def prepack_linears(model: nn.Module) -> None:
    for layer in linear_layers(model):
        layer.prepack()


def linear_layers(model: nn.Module) -> list[Linear]:
    """Every matmul of one forward, in order, the LM head last."""
    return [m for m in model.modules() if isinstance(m, Linear)]


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn that keeps x's shape (an MLP), MLP_CHUNK_ROWS rows at a time on CPU."""
    rows, chunk_rows = x.shape[0], MLP_CHUNK_ROWS
    if rows <= chunk_rows or x.device.type != "cpu":  # CUDA's caching allocator reuses its blocks
        return fn(x)
    out = torch.empty_like(x)
    for start in range(0, rows, chunk_rows):
        out[start:start + chunk_rows] = fn(x[start:start + chunk_rows])
    return out
