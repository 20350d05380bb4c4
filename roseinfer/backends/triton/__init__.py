"""The Triton backend (CUDA): Triton kernels for the KV write, decode attention (split over long
contexts) and prefill attention over the paged cache, variable lengths without padding
(kernels.py), the gated delta rule of hybrid models' linear layers on the state pool in place
(delta_rule.py) and mixture-of-experts layers as two grouped GEMMs over tokens sorted by expert
(fused_moe.py); decode steps replayed from CUDA graphs captured at start-up (cuda_graphs.py). It also
runs on CPU tensors under TRITON_INTERPRET=1, which is how the tests check it without a GPU."""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.backends.base import Backend, BatchLayout
from roseinfer.backends.torch_sdpa import padded_block_tables, split_decode_prefill
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention

logger = logging.getLogger(__name__)


@dataclass
class DecodeBatch:
    rows: torch.Tensor | None  # the decoding sequences' rows of the flat batch; None: all rows, in order
    block_tables: torch.Tensor  # [B, max_blocks]
    kv_lens: torch.Tensor  # [B]


@dataclass
class PrefillBatch:
    block_tables: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    max_q_len: int  # sizes the kernel's grid without reading q_lens back from the device


@dataclass
class TritonMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T]; -1 skips a row (the padding of a CUDA-graph batch)
    block_size: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    mlp_chunk_rows: int | None = None

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        from roseinfer.backends.triton import kernels

        kernels.store_kv(k, v, self.slot_mapping, *kv_cache)
        decode, prefill = self.decode, self.prefill
        options = {"sliding_window": layer.sliding_window, "logit_softcap": layer.logit_softcap,
                   "sinks": layer.sinks}
        if prefill is None and decode.rows is None:
            return kernels.paged_decode_attention(q, *kv_cache, decode.block_tables, decode.kv_lens, self.block_size,
                                                  layer.scale, **options)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decode is not None:
            out[decode.rows] = kernels.paged_decode_attention(q[decode.rows], *kv_cache, decode.block_tables,
                                                              decode.kv_lens, self.block_size, layer.scale, **options)
        if prefill is not None:
            kernels.paged_prefill_attention(q, *kv_cache, prefill.block_tables, prefill.q_starts, prefill.q_lens,
                                            prefill.kv_lens, self.block_size, layer.scale, out,
                                            max_q_len=prefill.max_q_len, **options)
        return out

    def delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          keep: torch.Tensor) -> torch.Tensor:
        from roseinfer.backends.triton.delta_rule import gated_delta_rule_

        # a decode is a one-token sequence of the same kernel, on the pool in place
        rows = (t.unsqueeze(1) for t in (q, k, v, g, beta))
        return gated_delta_rule_(*rows, states, slots, keep)[:, 0]

    def delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                           lens: torch.Tensor) -> torch.Tensor:
        from roseinfer.backends.triton.delta_rule import gated_delta_rule_

        return gated_delta_rule_(q, k, v, g, beta, states, slots, keep, lens)


class TritonBackend(Backend):
    name = "triton"
    graphs = None  # DecodeGraphs once captured

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        if importlib.util.find_spec("triton") is None:
            return False
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        decode, prefill = split_decode_prefill(layout)
        decode_batch = prefill_batch = None
        if decode:
            rows = None if not prefill else self.tensor([layout.q_starts[i] for i in decode])
            decode_batch = DecodeBatch(rows, padded_block_tables(self, layout, decode),
                                       self.tensor([layout.kv_lens[i] for i in decode]))
        if prefill:
            prefill_batch = PrefillBatch(padded_block_tables(self, layout, prefill),
                                         self.tensor([layout.q_starts[i] for i in prefill]),
                                         self.tensor([layout.q_lens[i] for i in prefill]),
                                         self.tensor([layout.kv_lens[i] for i in prefill]),
                                         max(layout.q_lens[i] for i in prefill))
        return TritonMetadata(self.tensor(layout.slot_mapping), layout.block_size, decode_batch, prefill_batch,
                              self.mlp_chunk_rows)

    def prepare_model(self, model: nn.Module, cpu_activations: str = "auto") -> None:
        from roseinfer.backends.triton import fused_moe

        fused_moe.install(model)
        super().prepare_model(model, cpu_activations)

    def capture(self, model: nn.Module, kv_caches: list[KVCache], max_num_seqs: int, max_blocks: int,
                block_size: int) -> None:
        if self.world_size > 1:  # a graph would have to capture the ranks' NCCL all-reduces: not done here
            logger.info("tensor parallelism: decode steps run eagerly (no CUDA graphs)")
            return
        if self.device.type == "cuda":  # the interpreter on CPU tensors has nothing to capture
            from roseinfer.backends.triton.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, model, kv_caches, max_num_seqs, max_blocks, block_size)

    def forward(self, model: nn.Module, layout: BatchLayout, kv_caches: list[KVCache]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.takes(layout):
            return self.graphs.replay(layout)
        return super().forward(model, layout, kv_caches)
