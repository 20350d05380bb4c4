"""Normalisation layers, in torch ops that round exactly as transformers does (a backend may swap in
its own kernel at load: backends/cpu/layers.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, it adds x into it first and returns (normed, stream),
    so that a kernel may do a decoder layer's residual add and its next norm in one pass."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._normalise(x)
        residual = residual + x
        return self._normalise(residual), residual

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, stream) where the stream is residual + x, or x itself at the first layer."""
        if residual is None:
            return self.forward(x), x
        return self.forward(x, residual)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # one call: bit-equal to LlamaRMSNorm in fp32 (tests/test_layers.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # LlamaRMSNorm's order: normalise in fp32, cast back, then scale.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)
