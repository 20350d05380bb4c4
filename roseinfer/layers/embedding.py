"""Token embeddings that can look their rows up in a tied LM head's prepacked copy.

A tied model's table is both the embedding and the LM head. The head is prepacked for oneDNN
(layers/linear.py), a copy in oneDNN's blocked layout, so a dense table kept for lookups would hold
the same weights twice (113 MB of the default model). oneDNN's layout for a [rows, dim] linear
weight is, on the machines measured, rows in blocks of B with the block's B values of each column
side by side: element (r, c) at ((r // B) * dim + c) * B + r % B (B = 64 with AVX-512). That makes
a row a strided slice of the packed buffer. The layout is oneDNN's to choose (by CPU and version),
so `read_rows_from` finds B by comparing every row with the dense table, once, and keeps the dense
table where no B reproduces it.
"""
from __future__ import annotations

import ctypes
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Row-block sizes oneDNN uses for fp32 weights across ISAs; 1 is plain row-major order.
_BLOCK_CANDIDATES = (64, 32, 16, 8, 4, 1)
_VERIFY_ROWS = 4096  # rows compared per chunk while verifying, so no second full table is built


class VocabEmbedding(nn.Embedding):
    """nn.Embedding whose rows come from a prepacked tied head once `read_rows_from` has succeeded."""

    packed: torch.Tensor | None = None  # the head's packed tensor: keeps `packed_rows` memory alive
    packed_rows: torch.Tensor | None = None  # [row blocks, dim, block] view of the packed buffer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_rows is None:
            return F.embedding(input_ids, self.weight)
        block = self.packed_rows.shape[2]
        return self.packed_rows[input_ids // block, :, input_ids % block]

    def read_rows_from(self, packed: torch.Tensor) -> bool:
        """Looks rows up in `packed` (a oneDNN-packed copy of this table) and drops the dense table;
        False, and nothing changed, where the packed layout is not one this class can read."""
        for rows in _packed_row_views(packed, self.num_embeddings, self.embedding_dim):
            if _same_rows(rows, self.weight):
                self.packed, self.packed_rows = packed, rows
                self.weight = None  # the packed copy now serves both the lookups and the head
                return True
        return False


def _packed_row_views(packed: torch.Tensor, num_rows: int, dim: int) -> Iterator[torch.Tensor]:
    """[ceil(num_rows / B), dim, B] float views of the packed buffer, one per block size B whose
    layout fits the buffer's size."""
    if packed.layout != torch._mkldnn or packed.dtype != torch.float32:
        return
    floats = torch.ops.mkldnn._nbytes(packed) // 4
    buffer = torch.frombuffer((ctypes.c_float * floats).from_address(torch.ops.mkldnn.data_ptr(packed)),
                              dtype=torch.float32)
    for block in _BLOCK_CANDIDATES:
        blocks = -(-num_rows // block)
        if blocks * dim * block == floats:
            yield buffer.view(blocks, dim, block)


@torch.no_grad()
def _same_rows(rows: torch.Tensor, table: torch.Tensor) -> bool:
    block = rows.shape[2]
    for start in range(0, table.shape[0], _VERIFY_ROWS):
        ids = torch.arange(start, min(start + _VERIFY_ROWS, table.shape[0]))
        if not torch.equal(rows[ids // block, :, ids % block], table[ids]):
            return False
    return True
