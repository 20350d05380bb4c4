"""The CPU backend's layers for weights kept as GGUF blocks (loader/quantized.py: a uint8 weight
[rows, bytes per row] carrying its `ggml_type`), swapped in at load (`install`): the linear runs
csrc/quant_matmul.c, which dequantizes each block in registers for few rows of x and into fp32 tiles
once for many (fp32 sums), and the embedding dequantizes only the rows it looks up, from the same
blocks a tied LM head reads. A fused linear whose sub-projections are stored in different types
(`block_parts`) runs each part's kernel into its rows of the output, in the same C call."""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.layers.linear import Linear

# the types csrc/quants.h dequantizes
QUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


def holds_blocks(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and (hasattr(weight, "ggml_type") or hasattr(weight, "block_parts"))


class QuantizedLinear(NativeRowsLinear):
    """y = x W^T (+ bias) with W in GGUF blocks; in_features stays the dense width. Every row count runs
    the C kernel (with the norm or SiLU before it where the model asks: NativeRowsLinear), which from
    32 rows (17 on AVX-512) multiplies tiles of W dequantized once (csrc/quant_tiled_matmul.c)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quant_matmul(x, self.weight, self.weight.ggml_type, self.bias)


class QuantizedPartsLinear(QuantizedLinear):
    """A QuantizedLinear whose output rows are parts in different GGUF types (loader/quantized.py's
    block_parts: a fused q/k/v or gate/up); `weight_parts` is the weight_part_t array the C matmuls read."""

    weight_parts: ctypes.Array

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.weight_matmul(x, self.native_weights, self.native_type, self.out_features, self.bias)


class QuantizedEmbedding(nn.Embedding):
    """Rows of a table in GGUF blocks, dequantized as they are looked up."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = ops.dequantize_rows(self.weight, self.weight.ggml_type, input_ids.reshape(-1), self.embedding_dim)
        return rows.view(*input_ids.shape, self.embedding_dim)


@torch.inference_mode()
def install(model: nn.Module) -> None:
    """The quantized classes in place of the generic ones, for the modules whose weight holds blocks."""
    for module in model.modules():
        if type(module) is Linear and hasattr(module.weight, "block_parts"):
            module.__class__ = QuantizedPartsLinear
            part = ops.weight_part_struct()
            base = module.weight.data_ptr()
            module.weight_parts = (part * len(module.weight.block_parts))(
                *(part(blocks=base + p.offset, type=p.type_id, rows=p.rows) for p in module.weight.block_parts))
            module.native_weights, module.native_type = ctypes.addressof(module.weight_parts), -len(module.weight_parts)
        elif type(module) is Linear and holds_blocks(module):
            module.__class__ = QuantizedLinear
            module.native_weights, module.native_type = module.weight.data_ptr(), module.weight.ggml_type
        elif type(module) is nn.Embedding and holds_blocks(module):
            module.__class__ = QuantizedEmbedding
