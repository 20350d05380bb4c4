"""The CPU backend's layers for weights kept as GGUF blocks (loader/quantized.py: a uint8 weight
[rows, bytes per row] carrying its `ggml_type`), swapped in at load (`install`): the linear runs
csrc/quant_matmul.c, which dequantizes each block in registers (fp32 sums), and the embedding
dequantizes only the rows it looks up, from the same blocks a tied LM head reads.

With int8 activations (--cpu-activations int8) the linear's type carries INT8_ACTIVATIONS, and every
matmul of it, the one-call decode stack's included, quantizes the rows of x to 8 bits and multiplies
with integer dot products (csrc/q8_activations.c) at any row count."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.layers.linear import Linear

# the types csrc/quants.h dequantizes, all of which csrc/q8_activations.c also multiplies by int8 rows
QUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})
INT8_ACTIVATIONS = 0x100  # csrc/quants.h's: a weight type with this bit set takes rows of x quantized to 8 bits


def holds_blocks(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and hasattr(weight, "ggml_type")


# From this many rows a slice of W dequantized into fp32 and torch's matmul (MKL) beat the block
# kernel, which decodes every weight again for each group of 8 rows: single-thread CPU time for the
# default model's gate/up (3072 x 576, Q4_1) at 32 rows 2.12 ms against 2.18, at 512 21 against 37.
DEQUANTIZED_MATMUL_ROWS = 32
SLICE_BYTES = 4 << 20  # fp32 bytes of W dequantized at once (the tied LM head whole would be 113 MB)


class QuantizedLinear(NativeRowsLinear):
    """y = x W^T (+ bias) with W in GGUF blocks; in_features stays the dense width. Few rows run the
    block kernel (with the norm or SiLU before it where the model asks: NativeRowsLinear); more
    multiply slices of W dequantized to fp32 (the same values). With int8 activations every row count
    runs the block kernel."""

    int8_activations: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < DEQUANTIZED_MATMUL_ROWS or self.int8_activations:
            return ops.quant_matmul(x, self.weight, self.native_type, self.bias)
        n = self.out_features
        step = max(1, SLICE_BYTES // (4 * self.in_features))
        if step >= n:
            return F.linear(x, self._dequantized(0, n), self.bias)
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for start in range(0, n, step):
            end = min(start + step, n)
            bias = None if self.bias is None else self.bias[start:end]
            out[:, start:end] = F.linear(x, self._dequantized(start, end), bias)
        return out

    def native_max_rows(self) -> int:
        return sys.maxsize if self.int8_activations else DEQUANTIZED_MATMUL_ROWS - 1

    def _dequantized(self, start: int, end: int) -> torch.Tensor:
        return ops.dequantize_rows(self.weight, self.weight.ggml_type, torch.arange(start, end), self.in_features)


class QuantizedEmbedding(nn.Embedding):
    """Rows of a table in GGUF blocks, dequantized as they are looked up."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = ops.dequantize_rows(self.weight, self.weight.ggml_type, input_ids.reshape(-1), self.embedding_dim)
        return rows.view(*input_ids.shape, self.embedding_dim)


@torch.inference_mode()
def install(model: nn.Module, int8_activations: bool = False) -> None:
    """The quantized classes in place of the generic ones, for the modules whose weight holds blocks;
    their linears multiply by rows of x quantized to 8 bits where int8_activations."""
    for module in model.modules():
        if type(module) is Linear and holds_blocks(module):
            module.__class__ = QuantizedLinear
            module.int8_activations = int8_activations
            module.native_weights = module.weight.data_ptr()
            module.native_type = module.weight.ggml_type | (INT8_ACTIVATIONS if int8_activations else 0)
        elif type(module) is nn.Embedding and holds_blocks(module):
            module.__class__ = QuantizedEmbedding
