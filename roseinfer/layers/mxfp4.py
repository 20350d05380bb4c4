"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints ship their experts: `*_blocks` [..., G, 16]
bytes holding 32 E2M1 values each (low nibble first), `*_scales` [..., G] E8M0 exponents biased by
127. Dequantized exactly: every value is a small float times a power of two."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

# E2M1: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, B] uint8 and scales [..., G] uint8 -> [..., G * 2 B] values."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2)


def dequantized_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each `NAME_blocks` / `NAME_scales` pair (in either order) given as
    NAME: [E, out, in] dequantized, transposed to transformers' in-memory [E, in, out]."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if not name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)):
            yield name, tensor
            continue
        waiting[name] = tensor
        base = name[:-len(BLOCKS_SUFFIX)]
        blocks, scales = waiting.get(base + BLOCKS_SUFFIX), waiting.get(base + SCALES_SUFFIX)
        if blocks is not None and scales is not None:
            del waiting[base + BLOCKS_SUFFIX], waiting[base + SCALES_SUFFIX]
            yield base, dequantize_mxfp4(blocks, scales).transpose(-1, -2)
    if waiting:
        raise ValueError(f"MXFP4 tensors without their pair: {sorted(waiting)}")
