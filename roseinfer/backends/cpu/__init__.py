"""The CPU backend: C kernels for attention over the paged cache and the row-wise ops, oneDNN-prepacked
linears with a C kernel for decode-sized matmuls, and the Llama decode stack in one call. fp32 only,
where the kernels build (kernels.py)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from roseinfer.backends.base import Backend, BatchLayout
from roseinfer.backends.cpu import layers, llama, ops, quantized, quantized_experts
from roseinfer.backends.cpu.attention import CPUMetadata, NativeDecodeGroup, NativePrefillGroup
from roseinfer.backends.cpu.kernels import kernels_available
from roseinfer.backends.cpu.layers import NativeRowsLinear
from roseinfer.backends.cpu.quantized import QUANTIZED_TYPES
from roseinfer.backends.torch_sdpa import AttentionGroup, padded_block_tables, sdpa_group, split_decode_prefill
from roseinfer.layers.linear import Linear
from roseinfer.models.config import ModelConfig


class CPUBackend(Backend):
    name = "cpu"
    quantized_types = QUANTIZED_TYPES

    def __init__(self, device: torch.device, dtype: torch.dtype, model_config: ModelConfig,
                 world_size: int = 1) -> None:
        super().__init__(device, dtype, model_config, world_size)
        self.group = model_config.num_heads // model_config.num_kv_heads
        # the C prefill kernel takes head dims of whole 16-float chunks up to 128; others use SDPA
        self.native_prefill = ops.prefill_attention_supported(model_config.head_dim, self.group)

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and kernels_available()

    def prepare_model(self, model: nn.Module, cpu_activations: str = "auto") -> None:
        # weights kept as GGUF blocks: their own layers, which layers.install leaves
        quantized.install(model, int8_activations=cpu_activations == "int8")
        layers.install(model)
        # after layers: its one-call path needs their native SiLU * up
        quantized_experts.install(model, int8_activations=cpu_activations == "int8")
        # the one-call decoder stack computes whole layers in C: no place for a tensor-parallel all-reduce
        llama.install(model, whole_stack=self.world_size == 1)
        super().prepare_model(model, cpu_activations)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # ~10x faster than torch's on [64, 49152] fp32 logits (2.6 ms a step there)
        return ops.argmax_rows(logits)

    def matmul_loop(self, layers: list[Linear], inputs: dict[int, torch.Tensor]) -> Callable[[int], None]:
        rows = next(iter(inputs.values())).shape[0]
        if not all(isinstance(layer, NativeRowsLinear) and layer.takes_native_rows(rows) for layer in layers):
            return super().matmul_loop(layers, inputs)
        weights = [(layer.native_weights, layer.native_type, layer.bias, layer.out_features, layer.in_features)
                   for layer in layers]
        widest = inputs[max(inputs)]
        return lambda count: ops.packed_matmul_steps(weights, widest, count)

    def build_metadata(self, layout: BatchLayout) -> CPUMetadata:
        decode, prefill = split_decode_prefill(layout)
        # A chunk of a few rows (a speculative verification, a chunked prefill's tail) would fill few
        # of the prefill kernel's query lanes, which it computes all the same: as decode rows, one
        # task each, it ran 2.4-15x faster (docs/profiling.md). Every row's K/V is stored before any
        # row attends, so each row reads the rows before it; a step of such rows alone takes the
        # fused decode path, the one-call decoder stack included.
        few_rows = [i for i in prefill if layout.q_lens[i] * self.group < ops.PREFILL_LANES]
        prefill = [i for i in prefill if i not in few_rows]
        groups: list[AttentionGroup] = []
        if decode or few_rows:
            seqs = sorted(decode + few_rows)
            row_seqs = [i for i in seqs for _ in range(layout.q_lens[i])]
            rows = [layout.q_starts[i] + j for i in seqs for j in range(layout.q_lens[i])]
            kv_lens = [layout.kv_lens[i] - layout.q_lens[i] + 1 + j for i in seqs for j in range(layout.q_lens[i])]
            groups.append(NativeDecodeGroup(self.tensor(rows), padded_block_tables(self, layout, row_seqs),
                                            self.tensor(kv_lens), layout.block_size, whole_batch=not prefill))
        if prefill and self.native_prefill:
            groups.append(NativePrefillGroup(
                padded_block_tables(self, layout, prefill), self.tensor([layout.q_starts[i] for i in prefill]),
                self.tensor([layout.q_lens[i] for i in prefill]), self.tensor([layout.kv_lens[i] for i in prefill]),
                layout.block_size))
        elif prefill:
            groups.append(sdpa_group(self, layout, prefill))
        return CPUMetadata(self.tensor(layout.slot_mapping), groups, self.mlp_chunk_rows, fused_decode=not prefill)
