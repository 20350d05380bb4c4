"""Token embeddings that can look their rows up in a tied LM head's prepacked copy.

A tied model's table is both the embedding and the LM head. The head is prepacked for oneDNN
(layers/linear.py), a copy in oneDNN's blocked layout, so a dense table kept for lookups would hold
the same weights twice (113 MB of the default model). oneDNN's layout for a [rows, dim] linear
weight is, on the machines measured, rows in blocks of B with the block's B values of each column
side by side (B = 64 with AVX-512), so a row is a strided slice of the packed buffer. Packing checks
that layout against the dense weight (`Linear.packed_block`); where it is some other, the embedding
keeps its dense table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.linear import packed_rows_view

if TYPE_CHECKING:
    from roseinfer.layers.linear import Linear


class VocabEmbedding(nn.Embedding):
    """nn.Embedding whose rows come from a prepacked tied head once `read_rows_from` has succeeded."""

    packed: torch.Tensor | None = None  # the head's packed tensor: keeps `packed_rows` memory alive
    packed_rows: torch.Tensor | None = None  # [row blocks, dim, block] view of the packed buffer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_rows is None:
            return F.embedding(input_ids, self.weight)
        block = self.packed_rows.shape[2]
        return self.packed_rows[input_ids // block, :, input_ids % block]

    def read_rows_from(self, head: Linear) -> bool:
        """Looks rows up in the packed copy of `head`, which shares this table, and drops the dense
        table; False, and nothing changed, where the packed layout is not one of row blocks."""
        if head.packed is None or head.packed_block is None:
            return False
        self.packed = head.packed
        self.packed_rows = packed_rows_view(head.packed, self.num_embeddings, self.embedding_dim, head.packed_block)
        self.weight = None  # the packed copy now serves both the lookups and the head
        return True
