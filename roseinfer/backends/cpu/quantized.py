"""The CPU backend's layers for weights kept as GGUF blocks (loader/quantized.py: a uint8 weight
[rows, bytes per row] carrying its `ggml_type`), swapped in at load (`install`): the linear runs
csrc/quant_matmul.c, which dequantizes each block in registers (fp32 sums), and the embedding
dequantizes only the rows it looks up, from the same blocks a tied LM head reads."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.layers.linear import Linear

# the types csrc/quants.h dequantizes
QUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})


def is_blocks(weight: torch.Tensor | None) -> bool:
    """Whether a weight is GGUF blocks (the loader sets its `ggml_type`)."""
    return weight is not None and hasattr(weight, "ggml_type")


def holds_blocks(module: nn.Module) -> bool:
    return is_blocks(getattr(module, "weight", None))


# From this many rows a slice of W dequantized into fp32 and torch's matmul (MKL) beat the block
# kernel, which decodes every weight again for each group of 8 rows: single-thread CPU time for the
# default model's gate/up (3072 x 576, Q4_1) at 32 rows 2.12 ms against 2.18, at 512 21 against 37.
DEQUANTIZED_MATMUL_ROWS = 32
SLICE_BYTES = 4 << 20  # fp32 bytes of W dequantized at once (the tied LM head whole would be 113 MB)


class QuantizedLinear(NativeRowsLinear):
    """y = x W^T (+ bias) with W in GGUF blocks; in_features stays the dense width. Few rows run the
    block kernel (with the norm or SiLU before it where the model asks: NativeRowsLinear); more
    multiply slices of W dequantized to fp32 (the same values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.weight, self.weight.ggml_type, self.bias)

    def native_max_rows(self) -> int:
        return DEQUANTIZED_MATMUL_ROWS - 1


def block_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias), W [n, k] held as GGUF blocks (uint8 [n, bytes per row] of GGML type
    qtype): the block kernel for few rows, slices of W dequantized to fp32 and torch's matmul for more."""
    if x.shape[0] < DEQUANTIZED_MATMUL_ROWS:
        return ops.quant_matmul(x, blocks, qtype, bias)
    n, k = blocks.shape[0], x.shape[1]
    step = max(1, SLICE_BYTES // (4 * k))
    if step >= n:
        return F.linear(x, ops.dequantize_rows(blocks, qtype, torch.arange(n), k), bias)
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, step):
        end = min(start + step, n)
        part = None if bias is None else bias[start:end]
        out[:, start:end] = F.linear(x, ops.dequantize_rows(blocks, qtype, torch.arange(start, end), k), part)
    return out


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
