"""Normalisation layers, written to round exactly as transformers does."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # one call: bit-equal to LlamaRMSNorm in fp32 (tests/test_layers.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # LlamaRMSNorm's order: normalise in fp32, cast back, then scale.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)
