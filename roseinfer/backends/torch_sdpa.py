"""The reference backend: torch ops only (F.linear, SDPA), on any device.

Sequences that decode (one query each) and sequences that prefill a chunk (several queries) form two
groups, each run as one batched SDPA call; the padded layouts, gather indices and masks are built
once per step here and shared by every layer, so no layer loops over sequences. A prefill group of
whole prompts needs no cache at all: its own K/V under a causal mask are the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from roseinfer.backends.base import Backend, BatchLayout
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention


class AttentionGroup(Protocol):
    """Some of a step's sequences, attended in one call."""

    whole_batch: bool  # the group is every row of the batch, in order (no gather or scatter)

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        """Attention output of this group's rows: [rows, H, D] in output order."""

    def attend_into(self, out: torch.Tensor, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, kv_cache: KVCache) -> None:
        """Writes this group's rows of out [T, H, D]."""


def attend_groups(groups: list[AttentionGroup], layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
    if len(groups) == 1 and groups[0].whole_batch:
        return groups[0].attend(layer, q, k, v, kv_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in groups:
        group.attend_into(out, layer, q, k, v, kv_cache)
    return out


@dataclass
class SdpaGroup:
    """Sequences padded to the longest query (Lq) for SDPA."""

    query_rows: torch.Tensor  # [B, Lq] rows of the flat batch (padding repeats a valid row)
    valid_slots: torch.Tensor  # [n_valid] real tokens' positions in the flattened [B * Lq] layout
    output_rows: torch.Tensor  # [n_valid] flat-batch rows, in valid_slots order
    block_size: int
    query_positions: torch.Tensor  # [B, Lq] each query's position in its sequence
    mask_dtype: torch.dtype
    whole_batch: bool = False
    fresh: bool = False  # whole prompts: attend to this step's K/V directly, no cache
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (padding: block 0, masked out)
    context_lens: torch.Tensor | None = None  # [B] keys cached per sequence (None when fresh)
    # additive [B, 1, Lq, keys] masks (0 = attend, -inf = not) by sliding window, built on first use
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def attend_into(self, out: torch.Tensor, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, kv_cache: KVCache) -> None:
        out.index_copy_(0, self.output_rows, self.attend(layer, q, k, v, kv_cache))

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        if self.fresh:
            queries, keys, values = (self._padded(t).transpose(1, 2) for t in (q, k, v))
            if layer.sliding_window is None and layer.logit_softcap is None and layer.sinks is None:
                # right padding is invisible to real queries under a causal mask: no explicit mask
                out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=layer.scale,
                                                     enable_gqa=layer.num_heads != layer.num_kv_heads)
            else:
                out = attention(queries, keys, values, self.mask(layer.sliding_window), layer)
            return self._unpadded(out)
        keys, values = (self._gather(cache, layer) for cache in kv_cache)
        mask = self.mask(layer.sliding_window)
        if self.query_rows.shape[1] == 1:
            # One query per sequence: the query heads sharing a KV head become that head's "query
            # length", so GQA needs no repeated K/V and one mask row serves them all.
            queries = q if self.whole_batch else q[self.output_rows]
            batch, groups = queries.shape[0], layer.num_heads // layer.num_kv_heads
            queries = queries.view(batch, layer.num_kv_heads, groups, layer.head_dim)
            return attention(queries, keys, values, mask, layer).reshape(batch, layer.num_heads, layer.head_dim)
        return self._unpadded(attention(self._padded(q).transpose(1, 2), keys, values, mask, layer))

    def mask(self, window: int | None) -> torch.Tensor:
        """Query at position p sees key j when j <= p, j is cached, and p - j < window."""
        if window not in self.masks:
            if self.fresh:
                keys = torch.arange(self.query_rows.shape[1], device=self.query_rows.device)
            else:
                keys = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.query_rows.device)
            keys, positions = keys.view(1, 1, -1), self.query_positions.unsqueeze(2)
            visible = keys <= positions
            if self.context_lens is not None:
                visible &= keys < self.context_lens.view(-1, 1, 1)
            if window is not None:
                visible &= positions - keys < window
            # additive float mask: SDPA would otherwise convert a bool mask in every layer
            mask = torch.zeros(visible.shape, dtype=self.mask_dtype, device=visible.device)
            self.masks[window] = mask.masked_fill_(~visible, float("-inf")).unsqueeze(1)
        return self.masks[window]

    def _gather(self, cache: torch.Tensor, layer: PagedAttention) -> torch.Tensor:
        """[B, Hkv, max_blocks * block_size, D] through the block tables. index_select on whole
        blocks is several times faster than advanced indexing on CPU."""
        batch, max_blocks = self.block_tables.shape
        blocks = cache.view(-1, self.block_size * layer.num_kv_heads * layer.head_dim)
        gathered = blocks.index_select(0, self.block_tables.flatten())
        return gathered.view(batch, max_blocks * self.block_size, layer.num_kv_heads, layer.head_dim).transpose(1, 2)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """[T, heads, D] flat-batch rows -> [B, Lq, heads, D]; index_select, several times faster here
        than advanced indexing with the 2-D row table."""
        return t.index_select(0, self.query_rows.flatten()).view(*self.query_rows.shape, *t.shape[1:])

    def _unpadded(self, out: torch.Tensor) -> torch.Tensor:
        """SDPA's [B, H, Lq, D] -> [n_valid, H, D], the real tokens in output_rows order."""
        return out.transpose(1, 2).flatten(0, 1).index_select(0, self.valid_slots)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              layer: PagedAttention) -> torch.Tensor:
    """q [B, H, Lq, D] (or a decode's [B, Hkv, H / Hkv, D]) over k, v [B, Hkv, Lk, D] under an
    additive mask. SDPA has neither soft-cap nor sinks, so such a layer spells the scores out, as
    transformers' eager attention does."""
    gqa = q.shape[1] != k.shape[1]
    if layer.logit_softcap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if layer.logit_softcap is None:
        return _attention_with_sinks(q, k, v, mask, layer)
    cap = layer.logit_softcap
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (layer.scale / cap)) * cap + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          layer: PagedAttention) -> torch.Tensor:
    """Each head's sink as one more score column, dropped after the softmax (gpt-oss's eager
    attention); q's heads dim 1 and 2 in order, as the sinks are."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale + mask
    sinks = layer.sinks.to(scores.dtype).view(1, q.shape[1], -1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def padded_block_tables(backend: Backend, layout: BatchLayout, idx: list[int]) -> torch.Tensor:
    """[len(idx), max_blocks] block tables of these sequences, padded with block 0 (never read)."""
    max_blocks = -(-max(layout.kv_lens[i] for i in idx) // layout.block_size)
    tables = [layout.block_tables[i][:max_blocks] for i in idx]
    return backend.tensor([t + [0] * (max_blocks - len(t)) for t in tables])


def sdpa_group(backend: Backend, layout: BatchLayout, idx: list[int]) -> SdpaGroup:
    """The group of sequences idx (all decodes, or all prompt chunks), padded for SDPA."""
    q_lens = backend.tensor([layout.q_lens[i] for i in idx])
    starts = backend.tensor([layout.q_starts[i] for i in idx])
    max_q = max(layout.q_lens[i] for i in idx)
    q_pos = torch.arange(max_q, device=backend.device).unsqueeze(0)  # [1, Lq]
    valid = q_pos < q_lens.unsqueeze(1)
    query_rows = starts.unsqueeze(1) + torch.minimum(q_pos, q_lens.unsqueeze(1) - 1)
    valid_slots = valid.flatten().nonzero().squeeze(1)
    output_rows = query_rows.flatten().index_select(0, valid_slots)
    if max_q > 1 and all(layout.kv_lens[i] == layout.q_lens[i] for i in idx):
        return SdpaGroup(query_rows, valid_slots, output_rows, layout.block_size, q_pos.expand(len(idx), -1),
                         backend.dtype, fresh=True)
    ctx_lens = backend.tensor([layout.kv_lens[i] for i in idx])
    return SdpaGroup(query_rows, valid_slots, output_rows, layout.block_size,
                     (ctx_lens - q_lens).unsqueeze(1) + q_pos, backend.dtype,
                     block_tables=padded_block_tables(backend, layout, idx), context_lens=ctx_lens)


def split_decode_prefill(layout: BatchLayout) -> tuple[list[int], list[int]]:
    """Sequence indices with one query this step, and those with more."""
    decode = [i for i, n in enumerate(layout.q_lens) if n == 1]
    return decode, [i for i, n in enumerate(layout.q_lens) if n > 1]


@dataclass
class TorchMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] cache slot of each token of the flat batch
    groups: list[AttentionGroup]
    mlp_chunk_rows: int | None = None

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        return attend_groups(self.groups, layer, q, k, v, kv_cache)


class TorchBackend(Backend):
    name = "torch"

    def build_metadata(self, layout: BatchLayout) -> TorchMetadata:
        groups = [sdpa_group(self, layout, idx) for idx in split_decode_prefill(layout) if idx]
        if len(groups) == 1 and groups[0].query_rows.shape[1] == 1:
            groups[0].whole_batch = True  # every row decodes, in order: no query gather or scatter
        return TorchMetadata(self.tensor(layout.slot_mapping), groups, self.mlp_chunk_rows)
