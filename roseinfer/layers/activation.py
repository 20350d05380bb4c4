"""Activations by the names transformers configs use (transformers' own definitions, so we round alike)."""
from __future__ import annotations

from typing import Callable

import torch
from transformers.activations import ACT2FN


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACT2FN:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(ACT2FN))}")
    return ACT2FN[name]
