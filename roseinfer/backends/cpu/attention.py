"""The CPU backend's attention: C kernels that read the paged cache in place (csrc/paged_attention.c,
csrc/prefill_attention.c), no padding, gather or mask; a step where every row decodes also takes
rotary, the KV write and attention from the q/k/v projection's output in one call."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.backends.cpu import delta_rule_ops, ops
from roseinfer.backends.torch_sdpa import AttentionGroup, attend_groups
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention


@dataclass
class NativeDecodeGroup:
    """Rows with one query each (a decode, or one row of a short chunk); each attends to the first
    kv_lens tokens of its sequence."""

    output_rows: torch.Tensor  # [B] their rows of the flat batch
    block_tables: torch.Tensor  # [B, max_blocks]
    kv_lens: torch.Tensor  # [B]
    block_size: int
    whole_batch: bool = False

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        queries = q if self.whole_batch else q[self.output_rows]
        return ops.paged_decode_attention(queries, *kv_cache, self.block_tables, self.kv_lens, self.block_size,
                                          layer.scale, layer.sliding_window, layer.logit_softcap, layer.sinks)

    def attend_into(self, out: torch.Tensor, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, kv_cache: KVCache) -> None:
        out.index_copy_(0, self.output_rows, self.attend(layer, q, k, v, kv_cache))


@dataclass
class NativePrefillGroup:
    """Prompt chunks, each at its own length: sequence i's queries are rows q_starts[i] .. + q_lens[i] - 1."""

    block_tables: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    block_size: int
    whole_batch: bool = False  # never: a step's decodes, if any, are another group

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        self.attend_into(out, layer, q, k, v, kv_cache)
        return out

    def attend_into(self, out: torch.Tensor, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, kv_cache: KVCache) -> None:
        ops.paged_prefill_attention(q, *kv_cache, self.block_tables, self.q_starts, self.q_lens, self.kv_lens,
                                    self.block_size, layer.scale, out, layer.sliding_window, layer.logit_softcap,
                                    layer.sinks)


@dataclass
class CPUMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] cache slot of each token of the flat batch
    groups: list[AttentionGroup]
    mlp_chunk_rows: int | None = None
    # every row is a decode row (a decode, or a row of a short chunk): a model may hand attend_qkv its
    # projection output, and a Llama decode step may run all its layers in one call (backends/cpu/llama.py)
    fused_decode: bool = False

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        ops.store_kv(k, v, self.slot_mapping, *kv_cache)
        return attend_groups(self.groups, layer, q, k, v, kv_cache)

    def delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          keep: torch.Tensor) -> torch.Tensor:
        # one C pass over each state, in place in the pool (csrc/gated_delta_rule.c)
        return delta_rule_ops.gated_delta_decode_(q, k, v, g, beta, states, slots, keep)

    def delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                           lens: torch.Tensor) -> torch.Tensor:
        # token by token in C, in place in the pool (csrc/gated_delta_rule.c)
        return delta_rule_ops.gated_delta_prefill_(q, k, v, g, beta, states, slots, keep, lens)

    def rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        # one C pass over the fresh projection output, in place; it rounds once less (an FMA) than
        # the torch path, which equals transformers' rotary bit for bit
        return ops.rotary_(x, rope)

    def attend_qkv(self, layer: PagedAttention, qkv: torch.Tensor, rope: torch.Tensor,
                   kv_cache: KVCache) -> torch.Tensor:
        if not self.fused_decode:
            return super().attend_qkv(layer, qkv, rope, kv_cache)
        group = self.groups[0]  # the same numbers as rotate, attend and flatten, in one C call
        return ops.decode_attention_qkv(qkv, rope, self.slot_mapping, *kv_cache, group.block_tables, group.kv_lens,
                                        group.block_size, layer.num_heads, layer.scale, layer.sliding_window,
                                        layer.logit_softcap, layer.sinks)
