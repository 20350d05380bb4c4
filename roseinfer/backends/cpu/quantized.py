"""The CPU backend's layers for weights kept as GGUF blocks (loader/quantized.py: a uint8 weight
[rows, bytes per row] carrying its `ggml_type`), swapped in at load (`install`): the linear runs
csrc/quant_matmul.c, which dequantizes each block in registers for few rows of x and into fp32 tiles
once for many (fp32 sums), and the embedding dequantizes only the rows it looks up, from the same
blocks a tied LM head reads. A fused linear whose sub-projections are stored in different types
(`block_parts`) runs each part's kernel into its rows of the output, in the same C call.

With int8 activations (--cpu-activations int8) the linear's type carries INT8_ACTIVATIONS, and every
matmul of it, the one-call decode stack's included, quantizes the rows of x to 8 bits and multiplies
with integer dot products (csrc/q8_activations.c) at any row count; a linear in parts does so for its
parts of the repacked types below (each part's tiles write its columns), and keeps fp32 rows for others.
A Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1 weight is repacked once, here, into csrc/q8_gemm.c's tiles of 16 rows
(INT8_REPACKED), which replace its blocks, except a tied LM head's: the embedding looks its rows up in
those, so the head keeps a repacked copy beside them (the one weight held twice). One weight load
there feeds several rows of x and the tile's 16 outputs accumulate in vector lanes."""
from __future__ import annotations

import ctypes
import itertools

import torch
from gguf import GGMLQuantizationType
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.layers.linear import Linear

# the types csrc/quants.h dequantizes
QUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"})
# those the int8 path multiplies by int8 rows (MXFP4 keeps fp32 rows under int8; Q5_K only repacked)
INT8_TYPES = frozenset({GGMLQuantizationType[name] for name in QUANTIZED_TYPES - {"MXFP4"}})
INT8_ACTIVATIONS = 0x100  # csrc/quants.h's: a weight type with this bit set takes rows of x quantized to 8 bits
INT8_REPACKED = 0x200  # csrc/quants.h's: with INT8_ACTIVATIONS, the weight is in csrc/q8_gemm.c's tiles
REPACKED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1"))


def is_blocks(weight: torch.Tensor | None) -> bool:
    """Whether a weight is GGUF blocks (the loader sets its `ggml_type`)."""
    return weight is not None and hasattr(weight, "ggml_type")


def holds_blocks(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return is_blocks(weight) or hasattr(weight, "block_parts")


class QuantizedLinear(NativeRowsLinear):
    """y = x W^T (+ bias) with W in GGUF blocks (or, with int8 activations, maybe repacked: see above);
    in_features stays the dense width. Every row count runs the C kernel (with the norm or SiLU before
    it where the model asks: NativeRowsLinear), which from 14 rows (8 for the K-quants) multiplies tiles of W
    dequantized once (csrc/quant_tiled_matmul.c), or, with int8 activations, integer dots at every row
    count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.weight_matmul(x, self.native_weights, self.native_type, self.out_features, self.bias)


class QuantizedPartsLinear(QuantizedLinear):
    """A QuantizedLinear whose output rows are parts in different GGUF types (loader/quantized.py's
    block_parts: a fused q/k/v or gate/up); `weight_parts` is the weight_part_t array the C matmuls read."""

    weight_parts: ctypes.Array


class QuantizedEmbedding(nn.Embedding):
    """Rows of a table in GGUF blocks, dequantized as they are looked up."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = ops.dequantize_rows(self.weight, self.weight.ggml_type, input_ids.reshape(-1), self.embedding_dim)
        return rows.view(*input_ids.shape, self.embedding_dim)


def _install_parts(module: Linear, int8_activations: bool) -> None:
    """A fused linear in parts of several types as a QuantizedPartsLinear; with int8 activations each part of
    a repacked type becomes its GEMM tiles (which write that part's columns of the wider output rows) and
    the weight the parts' bytes back to back; a part of another type keeps fp32 rows."""
    module.__class__ = QuantizedPartsLinear
    parts, flat = module.weight.block_parts, module.weight.view(-1)
    pieces, layouts = [], []
    for p in parts:
        blocks, layout = flat[p.offset:p.offset + p.nbytes], p.type_id
        if int8_activations and p.type_id in REPACKED_TYPES:
            blocks = ops.repack_for_int8_gemm(blocks.view(p.rows, -1), p.type_id, module.in_features)
            layout = p.type_id | INT8_ACTIVATIONS | INT8_REPACKED
        pieces.append(blocks)
        layouts.append(layout)
    if layouts != [p.type_id for p in parts]:
        module.weight = nn.Parameter(torch.cat(pieces), requires_grad=False)
    base, offsets = module.weight.data_ptr(), [0, *itertools.accumulate(piece.numel() for piece in pieces)]
    part = ops.weight_part_struct()
    module.weight_parts = (part * len(parts))(
        *(part(blocks=base + offset, type=layout, rows=p.rows) for p, offset, layout in zip(parts, offsets, layouts)))
    module.native_weights, module.native_type = ctypes.addressof(module.weight_parts), -len(parts)


@torch.inference_mode()
def install(model: nn.Module, int8_activations: bool = False) -> None:
    """The quantized classes in place of the generic ones, for the modules whose weight holds blocks;
    their linears multiply by rows of x quantized to 8 bits where int8_activations."""
    embedded = {m.weight.data_ptr() for m in model.modules() if type(m) is nn.Embedding and holds_blocks(m)}
    for module in model.modules():
        if type(module) is Linear and hasattr(module.weight, "block_parts"):
            _install_parts(module, int8_activations)
        elif type(module) is Linear and holds_blocks(module):
            module.__class__ = QuantizedLinear
            qtype = module.weight.ggml_type
            int8 = int8_activations and qtype in INT8_TYPES
            module.native_weights = module.weight.data_ptr()
            if int8 and qtype in REPACKED_TYPES:
                repacked = ops.repack_for_int8_gemm(module.weight, qtype, module.in_features)
                if module.weight.data_ptr() in embedded:  # a tied LM head: the embedding reads the blocks
                    module.repacked_weight = repacked
                else:
                    module.weight = nn.Parameter(repacked, requires_grad=False)
                module.native_weights, qtype = repacked.data_ptr(), qtype | INT8_REPACKED
            module.native_type = qtype | (INT8_ACTIVATIONS if int8 else 0)
        elif type(module) is nn.Embedding and holds_blocks(module):
            module.__class__ = QuantizedEmbedding
