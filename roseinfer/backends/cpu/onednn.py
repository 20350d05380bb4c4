"""torch's private oneDNN (mkldnn) ops, in one place, checked once against the running torch.

Prepacked linears need four ops that are not public API: `_reorder_linear_weight` (pack once),
`_linear_pointwise` (multiply), and `data_ptr` / `_nbytes` of the packed tensor (read its layout).
A torch release may rename or drop them, so `available()` runs each on a tiny weight and compares
the product with F.linear; where anything fails it says why once and the CPU backend keeps
F.linear.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Row-block sizes oneDNN uses for fp32 weights across ISAs; 1 is plain row-major order.
ROW_BLOCK_CANDIDATES = (64, 32, 16, 8, 4, 1)
_VERIFY_BLOCKS = 64  # row blocks compared at a time while verifying a layout: no second full copy


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def address(packed: torch.Tensor) -> int:
    return torch.ops.mkldnn.data_ptr(packed)


@functools.cache
def available() -> bool:
    """Whether the ops exist and multiply as F.linear does here; logs the reason once where not."""
    if not torch.backends.mkldnn.is_available():
        logger.warning("torch has no oneDNN here: the CPU backend's linears use F.linear")
        return False
    try:
        weight = torch.arange(24, dtype=torch.float32).view(6, 4) / 7
        x = torch.ones(3, 4)
        packed = pack(weight)
        ok = torch.allclose(linear(x, packed, None), F.linear(x, weight), atol=1e-5)
        ok = ok and address(packed) != 0 and torch.ops.mkldnn._nbytes(packed) >= weight.numel() * 4
    except (AttributeError, RuntimeError) as exc:
        logger.warning("torch's private oneDNN ops failed (%s): the CPU backend's linears use F.linear", exc)
        return False
    if not ok:
        logger.warning("torch's private oneDNN ops gave a wrong product: the CPU backend's linears use F.linear")
    return ok


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
    buffer = torch.frombuffer((ctypes.c_float * floats).from_address(address(packed)), dtype=torch.float32)
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
