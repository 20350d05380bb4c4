"""Rotary position embeddings, with the scaled variants transformers defines (llama3, linear, yarn,
longrope, proportional), per layer type where a model has several, and partial rotary (only the first `partial_rotary_factor` of each head rotates).

HF checkpoints rotate each head as two halves (x[i] pairs with x[i + d/2]). Here the pairs are
adjacent (x[2i], x[2i+1]) so that a rotation is one complex multiply: one kernel instead of the
six of the half-split form (slices, neg, cat, two muls, add). The model reorders q/k projection rows at load time (`interleave_rotary_rows`); a
permutation of head_dim applied to both q and k leaves every q.k score, and so the output, unchanged.

Under partial rotary the dims that do not rotate keep their places and get the rotation 1 + 0i,
which leaves them bit for bit as they are; so every backend's rotary path, written for whole heads,
serves partial rotary unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from roseinfer.layers.rope_parameters import (STATIC_ROPE_TYPES, long_rope_original_positions, rope_parameters,
                                              rotary_dim)


class RotaryEmbedding(nn.Module):
    """Precomputes cos + i*sin for every position once; a step looks its rows up once.

    LongRoPE keeps two tables one after the other: rows [0, max_positions) with the short factors,
    for a sequence within the original context, rows [max_positions, 2 * max_positions) with the
    long ones, for a sequence past it (the model runner shifts its positions there; the scheduler
    recomputes a sequence's cache when it crosses: Request.rotates_long)."""

    def __init__(self, head_dim: int, max_positions: int, config: dict[str, Any],
                 layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
        dim = rotary_dim(head_dim, config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            rotations = _rotations(positions, inv_freq, 1.0)
        elif rope_type == "longrope":
            short, scaling = _scaled_inv_freq(config)
            rotations = _rotations(positions, short, scaling)
            original = long_rope_original_positions(config)
            if original is not None:
                long_rows = _rotations(positions, _scaled_inv_freq(config, seq_len=original + 1)[0], scaling)
                rotations = torch.cat([rotations, long_rows])
        else:
            rotations = _rotations(positions, *_scaled_inv_freq(config, layer_type=layer_type))
        # The dims that do not rotate pair up with rotation 1 + 0i: they pass through unchanged.
        unrotated = torch.ones(rotations.shape[0], (head_dim - dim) // 2, dtype=rotations.dtype)
        # A plain attribute, not a buffer: `model.to(dtype)` would cast a complex buffer to real. The
        # model is built on its device, so the table is created there and never moves.
        self.rotations = torch.cat([rotations, unrotated], dim=1)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations for a step's positions, [T, 1, D/2] complex64; looked up once, used by every layer.
        Half-precision models rotate in float32 too: torch has no fast complex32 kernels."""
        return self.rotations[positions].unsqueeze(1)


def _scaled_inv_freq(config: dict[str, Any], seq_len: int | None = None,
                     layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    # transformers owns the scaled-frequency formulas; reuse them so we match exactly
    # (imported only here: default-rope models never load transformers).
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    rope_type = rope_parameters(config, layer_type)["rope_type"]
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, seq_len=seq_len, layer_type=layer_type)


def _rotations(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """The same float32 cos/sin as transformers, one complex number per rotating pair: [P, dim/2]."""
    freqs = torch.outer(positions, inv_freq.float())
    return torch.complex(freqs.cos() * scaling, freqs.sin() * scaling)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with rotary pairs adjacent; rotations: [T, 1, D/2] complex. Returns [T, heads, D],
    equal to transformers' rotary bit for bit (a backend may rotate in place instead: backends/cpu)."""
    tokens, heads, dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(tokens, heads, dim // 2, 2))
    return torch.view_as_real(pairs * rotations).view(tokens, heads, dim).to(x.dtype)


def interleave_rotary_rows(rows: torch.Tensor, head_dim: int, rotary_dims: int | None = None) -> torch.Tensor:
    """Reorders the output rows of a q/k projection (weight, bias or per-head norm weight) from
    HF's half-split rotary layout to adjacent pairs, within each head's first rotary_dims rows
    (all by default): [h, 2, r/2] -> [h, r/2, 2]; the rows after them keep their places."""
    rotary_dims = head_dim if rotary_dims is None else rotary_dims
    heads = rows.shape[0] // head_dim
    per_head = rows.reshape(heads, head_dim, *rows.shape[1:])
    rotating = per_head[:, :rotary_dims].reshape(heads, 2, rotary_dims // 2, *rows.shape[1:]).transpose(1, 2)
    return torch.cat([rotating.reshape(heads, rotary_dims, *rows.shape[1:]), per_head[:, rotary_dims:]],
                     dim=1).reshape(rows.shape)
