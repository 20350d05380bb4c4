"""Rotary position embeddings, with the scaled variants transformers defines (llama3, linear, yarn,
proportional).

HF checkpoints rotate each head as two halves (x[i] pairs with x[i + d/2]). Here the pairs are
adjacent (x[2i], x[2i+1]) so that a rotation is one complex multiply: one kernel instead of the
six of the half-split form (slices, neg, cat, two muls, add), which measured 10-40x faster at 64-256
tokens on CPU. The model reorders q/k projection rows at load time (`interleave_rotary_rows`); a
permutation of head_dim applied to both q and k leaves every q.k score, and so the output, unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict:
    """The rope settings of a config.json: `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta`; with layer_type, that type's entry of a per-type
    `rope_parameters` (Gemma 3 and 4)."""
    if layer_type is not None:
        return dict(config["rope_parameters"][layer_type])
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """Precomputes cos + i*sin for every position once; a step looks its rows up once."""

    def __init__(self, head_dim: int, max_positions: int, config: dict[str, Any],
                 layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            # transformers owns the scaled-frequency formulas; reuse them so we match exactly
            # (imported only here: default-rope models never load transformers).
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            fields = {k: v for k, v in config.items() if k != "model_type"}
            hf_config = AutoConfig.for_model(config["model_type"], **fields)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, layer_type=layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        # The same float32 cos/sin as transformers, one complex number per pair. A plain attribute,
        # not a buffer: `model.to(dtype)` would cast a complex buffer to real. The model is built on
        # its device, so the table is created there and never moves.
        self.rotations = torch.complex(freqs.cos() * scaling, freqs.sin() * scaling)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations for a step's positions, [T, 1, D/2] complex64; looked up once, used by every layer.
        Half-precision models rotate in float32 too: torch has no fast complex32 kernels."""
        return self.rotations[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with rotary pairs adjacent; rotations: [T, 1, D/2] complex. Returns [T, heads, D],
    equal to transformers' rotary bit for bit (a backend may rotate in place instead: backends/cpu)."""
    tokens, heads, dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(tokens, heads, dim // 2, 2))
    return torch.view_as_real(pairs * rotations).view(tokens, heads, dim).to(x.dtype)


def interleave_rotary_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorders the output rows of a q/k projection (weight, bias or per-head norm weight) from
    HF's half-split rotary layout to adjacent pairs, within each head: [h, 2, d/2] -> [h, d/2, 2]."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
