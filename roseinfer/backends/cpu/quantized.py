"""The CPU backend's layers for weights kept as GGUF blocks (loader/quantized.py: a uint8 weight
[rows, bytes per row] carrying its `ggml_type`), swapped in at load (`install`): the linear runs
csrc/quant_matmul.c, which dequantizes each block in registers for few rows of x and into fp32 tiles
once for many (fp32 sums), and the embedding dequantizes only the rows it looks up, from the same
blocks a tied LM head reads."""
from __future__ import annotations

import torch
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.layers.linear import Linear

# the types csrc/quants.h dequantizes
QUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


def is_blocks(weight: torch.Tensor | None) -> bool:
    """Whether a weight is GGUF blocks (the loader sets its `ggml_type`)."""
    return weight is not None and hasattr(weight, "ggml_type")


def holds_blocks(module: nn.Module) -> bool:
    return is_blocks(getattr(module, "weight", None))


class QuantizedLinear(NativeRowsLinear):
    """y = x W^T (+ bias) with W in GGUF blocks; in_features stays the dense width. Every row count runs
    the C kernel (with the norm or SiLU before it where the model asks: NativeRowsLinear), which from
    32 rows (17 on AVX-512) multiplies tiles of W dequantized once (csrc/quant_tiled_matmul.c)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quant_matmul(x, self.weight, self.weight.ggml_type, self.bias)


class QuantizedEmbedding(nn.Embedding):
    """Rows of a table in GGUF blocks, dequantized as they are looked up."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = ops.dequantize_rows(self.weight, self.weight.ggml_type, input_ids.reshape(-1), self.embedding_dim)
        return rows.view(*input_ids.shape, self.embedding_dim)


@torch.inference_mode()
def install(model: nn.Module) -> None:
    """The quantized classes in place of the generic ones, for the modules whose weight holds blocks."""
    for module in model.modules():
        if type(module) is Linear and holds_blocks(module):
            module.__class__ = QuantizedLinear
            module.native_weights, module.native_type = module.weight.data_ptr(), module.weight.ggml_type
        elif type(module) is nn.Embedding and holds_blocks(module):
            module.__class__ = QuantizedEmbedding
