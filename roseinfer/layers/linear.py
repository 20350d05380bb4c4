"""Linear layers and the helpers that walk them, in plain torch (a backend may swap in a faster
subclass at load: backends/cpu/layers.py prepacks the weights for oneDNN)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear, under the name the models use for every matmul (so `linear_layers` finds them)."""

    def reset_parameters(self) -> None:
        """No random values: the checkpoint sets every weight (the loaders refuse one it lacks), and an
        untouched torch.empty costs no memory until written, so a weight kept in GGUF blocks never
        costs its fp32 size at load."""

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def linear_layers(model: nn.Module) -> list[Linear]:
    """Every matmul of one forward, in order, the LM head last."""
    return [m for m in model.modules() if isinstance(m, Linear)]


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_rows: int | None) -> torch.Tensor:
    """fn(x) for a row-wise fn that keeps x's shape (an MLP), chunk_rows rows at a time where given
    (the step's AttentionMetadata.mlp_chunk_rows: a backend whose allocator keeps a step's widest
    tensors for good asks for pieces)."""
    rows = x.shape[0]
    if chunk_rows is None or rows <= chunk_rows:
        return fn(x)
    out = torch.empty_like(x)
    for start in range(0, rows, chunk_rows):
        out[start:start + chunk_rows] = fn(x[start:start + chunk_rows])
    return out
