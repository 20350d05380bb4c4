"""Activations by the names transformers configs use.

Plain torch functions rather than transformers.activations, whose import is slow and heavy for what
it gives. gelu_new is written out as GPT-2 (and transformers) defines it, so the
rounding matches the reference exactly.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class ActivationAndMul(nn.Module):
    """act(gate) * up over a fused [gate | up] projection."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.act = get_activation(name)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        # multiply in place: one [T, intermediate] buffer fewer per layer
        return self.act(gate).mul_(up)


class ClampedSwigluAndMul(nn.Module):
    """gpt-oss's experts over a fused [gate | up] projection: the gate clamped above at `limit`, up to
    ±limit, then gate * sigmoid(alpha * gate) * (up + 1), in transformers' order of operations."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
