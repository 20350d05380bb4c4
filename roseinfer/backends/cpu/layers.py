"""The CPU backend's layers, swapped into a loaded model in place of the generic ones (`install`).

Linear: F.linear on CPU goes to MKL's sgemm, which repacks the weight on every call; with the weight
reordered once into oneDNN's blocked layout the default model's matmuls ran 1.2-2.9x faster (fp32,
2 threads; docs/profiling.md), differing from F.linear only by summation order. oneDNN builds and
caches one primitive per input shape for the life of the process (~0.6 MB per row count and layer
shape; a server sees every row count up to its token budget), so rows are padded up to one of four
sizes per octave (`padded_rows`). Decode batches go elsewhere: with few rows a matmul streams the
weights, and where oneDNN's layout is 64-row blocks on an AVX-512 or AVX2 CPU, up to
PACKED_MATMUL_MAX_ROWS rows (256 and 16) go to csrc/packed_matmul.c, which reads the same packed copy, and can compute its input from
the previous op (RMSNorm, SiLU * up) in the same call.

RMSNorm and SiLU * up: one C pass each instead of torch's chains of elementwise ops. A tied
embedding looks its rows up in the LM head's packed copy instead of holding the table twice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.backends.cpu import onednn, ops
from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.linear import Linear, linear_layers
from roseinfer.layers.norm import RMSNorm


class NativeRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # per-head q/k norms: torch's path
            return super().forward(x, residual)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps, residual), residual  # residual updated in place


class NativeSiluAndMul(ActivationAndMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate_up) if gate_up.dim() == 2 else super().forward(gate_up)


class NativeRowsLinear(Linear):
    """A Linear whose few-row matmuls run in C and can take the previous op (RMSNorm, SiLU * up) into
    the same call: PackedLinear (packed fp32) and QuantizedLinear (GGUF blocks, backends/cpu/quantized.py)."""

    native_weights: int | None = None  # the weight's address where few rows go to the C kernels
    native_type: int = 0  # its layout there: 0 packed fp32, else the GGML type of its blocks

    def forward_normed(self, x: torch.Tensor, norm: NativeRMSNorm, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on norm(x), x first added into the residual stream where there is one (the
        stream starts at x where there is none); returns (output, stream). Where the rows go to the
        C matmul, the norm is its prologue: one call, the same results."""
        if self.takes_native_rows(x.shape[0]):
            out = ops.rms_norm_packed_matmul(x, norm.weight, norm.eps, residual, self.native_weights,
                                             self.native_type, self.out_features, self.bias)
            return out, x if residual is None else residual
        h, stream = norm.add_and_norm(x, residual)
        return self.forward(h), stream

    def forward_activated(self, gate_up: torch.Tensor, act: ActivationAndMul) -> torch.Tensor:
        """This layer on act(gate) * up; one C call where SiLU's rows go to the C matmul."""
        if isinstance(act, NativeSiluAndMul) and self.takes_native_rows(gate_up.shape[0]):
            return ops.silu_mul_packed_matmul(gate_up, self.native_weights, self.native_type, self.out_features,
                                              self.bias)
        return self.forward(act.forward(gate_up))

    def takes_native_rows(self, rows: int) -> bool:
        """Whether a matmul of `rows` rows runs in the C kernels."""
        return self.native_weights is not None and 0 < rows <= self.native_max_rows()

    def native_max_rows(self) -> int:
        return ops.PACKED_MATMUL_MAX_ROWS


class PackedLinear(NativeRowsLinear):
    """A Linear whose weight oneDNN packed once (`pack`); the dense weight is let go."""

    packed: torch.Tensor
    packed_block: int | None  # B where `packed` is the weight's rows in blocks of B (onednn.packed_rows_view)

    def pack(self) -> None:
        weight = self.weight.detach()
        self.packed = onednn.pack(weight)
        self.packed_block = onednn.packed_row_block(self.packed, weight)
        if self.packed_block == ops.PACKED_MATMUL_BLOCK and ops.packed_matmul_suits_cpu():
            self.native_weights = onednn.address(self.packed)
        # A weight shared with an embedding (tied LM head) stays alive through the embedding until it
        # reads its rows from this packed copy (PackedRowsEmbedding).
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]  # x is [rows, in_features] in every model here
        if self.takes_native_rows(rows):
            return ops.packed_matmul(x, self.native_weights, self.out_features, self.bias)
        padded = padded_rows(rows)
        if padded == rows:
            return onednn.linear(x, self.packed, self.bias)
        return onednn.linear(F.pad(x, (0, 0, 0, padded - rows)), self.packed, self.bias)[:rows]

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class PackedRowsEmbedding(nn.Embedding):
    """An embedding whose table is a prepacked tied LM head's: rows are strided slices of the packed
    buffer (rows in blocks of B, each column's B values side by side; onednn.packed_row_block has
    checked that layout against the dense weight)."""

    packed: torch.Tensor  # the head's packed tensor: keeps `packed_rows` memory alive
    packed_rows: torch.Tensor  # [row blocks, dim, block] view of the packed buffer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        block = self.packed_rows.shape[2]
        return self.packed_rows[input_ids // block, :, input_ids % block]


def padded_rows(rows: int) -> int:
    """rows rounded up to the next of four sizes per octave above 8: 8, 10, 12, 14, 16, 20, 24, ...
    (48 sizes up to 8192 rows, at most 25 % padded rows, none for 1-8, 16, 64, 256, 2048, ...)."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)  # a quarter of the largest power of two <= rows
    return -(-rows // step) * step


@torch.inference_mode()
def to_packed(layer: Linear) -> PackedLinear:
    """The layer as a PackedLinear, its weight packed (the class swap keeps its parameters)."""
    layer.__class__ = PackedLinear
    layer.pack()
    return layer


@torch.inference_mode()
def install(model: nn.Module) -> None:
    """Swap the CPU layers in: each keeps its parameters and changes only how it computes (the
    subclasses add no state the generic layer lacks but what `pack` sets)."""
    dense = [layer for layer in linear_layers(model) if type(layer) is Linear]  # not GGUF blocks (quantized.py)
    tied = [(head, emb) for head in dense for emb in model.modules()
            if type(emb) is nn.Embedding and emb.weight is head.weight]
    if onednn.available():
        for layer in dense:
            to_packed(layer)
        for head, embedding in tied:
            view = None if head.packed_block is None else \
                onednn.packed_rows_view(head.packed, embedding.num_embeddings, embedding.embedding_dim, head.packed_block)
            if view is not None:
                embedding.__class__ = PackedRowsEmbedding
                embedding.packed, embedding.packed_rows = head.packed, view
                embedding.weight = None  # the packed copy now serves both the lookups and the head
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = NativeRMSNorm
        elif type(module) is ActivationAndMul and module.name in ("silu", "swish"):
            module.__class__ = NativeSiluAndMul
