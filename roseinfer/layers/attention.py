"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks * block_size, num_kv_heads, head_dim]`;
token t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
The batch is one flat list of tokens. Sequences that decode (one query each) and sequences
that prefill a chunk (several queries) form two groups, each run as one batched call; the masks,
gather indices or lengths are built once per step by the model runner and shared by every layer,
so there is no Python loop over sequences here. With the C kernels (CPU fp32) both groups read
the cache in place (csrc/paged_attention.c, csrc/prefill_attention.c). On the torch path each
group is padded for SDPA, and a prefill group of whole prompts needs no cache at all: its own
K/V under a causal mask are the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roseinfer.layers import native


@dataclass
class AttentionGroup:
    block_size: int
    # the padded layout of the torch path and of native decode (None for native prefill)
    query_rows: torch.Tensor | None = None  # [B, Lq] rows of the flat batch (padding repeats a valid row)
    valid_slots: torch.Tensor | None = None  # [n_valid] real tokens' positions in the flattened [B * Lq] layout
    output_rows: torch.Tensor | None = None  # [n_valid] flat-batch rows, in valid_slots order
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (padding: block 0, masked out)
    mask: torch.Tensor | None = None  # [B, 1, Lq, max_blocks * block_size] additive: 0 = attend, -inf = not
    whole_batch: bool = False  # the group is every row of the batch, in order (no gather/scatter)
    fresh: bool = False  # prefill with nothing cached before it: attend to this step's K/V directly
    kv_lens: torch.Tensor | None = None  # [B] tokens each sequence attends to (native kernels, instead of mask)
    # native prefill: sequence i's chunk is rows q_starts[i] .. q_starts[i] + q_lens[i] - 1 of the batch
    q_starts: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.q_lens is None and self.query_rows.shape[1] == 1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token of the flat batch
    groups: list[AttentionGroup]
    native: bool = False  # CPU fp32 C kernels for the cache writes and decode (layers/native.py)
    # every row decodes, with the C kernels: a model may hand PagedAttention.decode_qkv its
    # projection output, for rotary + KV write + attention in one call
    fused_decode: bool = False


class PagedAttention:
    """Runs wherever torch runs (CPU and CUDA); the native kernels only where meta.native says."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H, D]."""
        k_cache, v_cache = kv_cache
        if meta.native:
            native.store_kv(k, v, meta.slot_mapping, k_cache, v_cache)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].whole_batch:
            return self._group(q, k_cache, v_cache, meta.groups[0], k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group in meta.groups:
            if group.q_lens is not None:  # native prefill writes its chunks' rows of out in place
                native.paged_prefill_attention(q, k_cache, v_cache, group.block_tables, group.q_starts, group.q_lens,
                                               group.kv_lens, group.block_size, self.scale, out)
            else:
                out.index_copy_(0, group.output_rows, self._group(q, k_cache, v_cache, group, k, v))
        return out

    def decode_qkv(self, qkv: torch.Tensor, rope: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata) -> torch.Tensor:
        """Where meta.fused_decode: qkv [T, (H + 2 * Hkv) * D] as the projection left it (rotated in
        place) and rope [T, 1, D/2] complex; returns [T, H * D]. The same numbers as rotating,
        calling this object and flattening, with two C calls and six tensor views a layer fewer."""
        group = meta.groups[0]
        return native.decode_attention_qkv(qkv, rope, meta.slot_mapping, *kv_cache, group.block_tables, group.kv_lens,
                                           group.block_size, self.num_heads, self.scale)

    def _gather(self, cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """[B, Hkv, max_blocks * block_size, D] through the block tables. index_select on whole
        blocks is several times faster than advanced indexing on CPU."""
        batch, max_blocks = group.block_tables.shape
        blocks = cache.view(-1, group.block_size * self.num_kv_heads * self.head_dim)
        gathered = blocks.index_select(0, group.block_tables.flatten())
        return gathered.view(batch, max_blocks * group.block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               group: AttentionGroup, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if group.fresh:
            # Whole prompts from position 0: this step's K/V are all there is, and right padding
            # is invisible to real queries under a causal mask -- no cache gather, no explicit mask.
            queries, keys, values = (self._padded(t, group).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            return self._unpadded(out, group)
        if group.kv_lens is not None:  # native decode: the runner set lengths instead of a mask
            queries = q if group.whole_batch else q[group.output_rows]
            return native.paged_decode_attention(queries, k_cache, v_cache, group.block_tables, group.kv_lens,
                                                 group.block_size, self.scale)
        keys, values = self._gather(k_cache, group), self._gather(v_cache, group)
        if group.is_decode:
            # One query per sequence: the query heads sharing a KV head become that head's
            # "query length", so GQA needs no repeated K/V and one mask row serves them all.
            queries = q if group.whole_batch else q[group.output_rows]
            batch = queries.shape[0]
            groups = self.num_heads // self.num_kv_heads
            queries = queries.view(batch, self.num_kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=self.scale)
            return out.reshape(batch, self.num_heads, self.head_dim)
        queries = self._padded(q, group).transpose(1, 2)  # [B, H, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self._unpadded(out, group)

    @staticmethod
    def _padded(t: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """[T, heads, D] flat-batch rows -> [B, Lq, heads, D]. index_select, because advanced indexing
        with the 2-D row table took 0.7-0.8 ms against 0.11-0.15 ms for a 2048-token prefill's q."""
        return t.index_select(0, group.query_rows.flatten()).view(*group.query_rows.shape, *t.shape[1:])

    @staticmethod
    def _unpadded(out: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """SDPA's [B, H, Lq, D] -> [n_valid, H, D], the real tokens in output_rows order (a boolean
        mask index took 0.84 ms against 0.23 ms here, same prefill)."""
        return out.transpose(1, 2).flatten(0, 1).index_select(0, group.valid_slots)
