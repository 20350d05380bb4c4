"""Attention over the paged KV cache, as the models see it: one layer object per decoder layer, and a
per-step AttentionMetadata that the chosen backend builds (backends/) and that does the work.

The cache of one layer is a pair of tensors `[num_blocks * block_size, num_kv_heads, head_dim]`;
token t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
The batch is one flat list of tokens. A backend's metadata writes this step's K/V into the cache
and attends, once per layer, from index tensors it built once for the step; the models never ask
which backend that is.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from roseinfer.layers.gated_delta_rule import LinearStateBatch, chunked_prefill, recurrent_step
from roseinfer.layers.rotary import apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionMetadata(ABC):
    """One step's attention state, shared by every layer; each backend has its own subclass."""

    # rows a model's MLP takes per pass (layers/linear.py in_row_chunks); None: all at once
    mlp_chunk_rows: int | None = None
    # hybrid models: each sequence's state slot, for the linear-attention layers (layers/gated_delta_rule.py)
    linear_state: LinearStateBatch | None = None

    @abstractmethod
    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache) -> torch.Tensor:
        """Write k, v [T, Hkv, D] into the cache, then attend with q [T, H, D]; returns [T, H, D]."""

    def delta_rule_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          keep: torch.Tensor) -> torch.Tensor:
        """The gated delta rule's decode step for a linear-attention layer (layers/gated_delta_rule.py
        recurrent_step): q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]; sequence i continues the state
        states[slots[i]] (from zeros where keep[i] is 0) and leaves its next state there. Returns o
        [n, H, Dv]; a backend may update the states in place."""
        o, states[slots] = recurrent_step(q, k, v, g, beta, states[slots] * keep[:, None, None, None])
        return o

    def delta_rule_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                           lens: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over prefill chunks (layers/gated_delta_rule.py chunked_prefill): q, k
        [n, L, H, Dk], v [n, L, H, Dv], g, beta [n, L, H], right-padded (padding zeroed), sequence i's
        first lens[i] tokens continuing states[slots[i]] as delta_rule_decode does. Returns o
        [n, L, H, Dv], whose padding rows a backend need not write."""
        o, states[slots] = chunked_prefill(q, k, v, g, beta, states[slots] * keep[:, None, None, None])
        return o

    def rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on x [T, heads, D] (pairs adjacent, layers/rotary.py); x is a fresh
        projection output that a backend may rotate in place."""
        return apply_rotary(x, rope)

    def attend_qkv(self, layer: PagedAttention, qkv: torch.Tensor, rope: torch.Tensor,
                   kv_cache: KVCache) -> torch.Tensor:
        """Rotary on q and k, the KV write and attention from a fused projection's output
        qkv [T, (H + 2 * Hkv) * D]; returns [T, H * D]."""
        tokens, q_heads, kv_heads, dim = qkv.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        # q and k side by side as one [T, H + Hkv, D] view: one rotary pass instead of two
        qk = self.rotate(qkv[:, :(q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim), rope)
        v = qkv[:, (q_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
        return self.attend(layer, qk[:, :q_heads], qk[:, q_heads:], v, kv_cache).reshape(tokens, q_heads * dim)


class PagedAttention:
    """A layer's attention shape and its per-layer options; the step's metadata does the work.

    The options follow transformers: with `sliding_window` W, the query at position p sees key k
    when k <= p and p - k < W (its last W positions, itself included); with `logit_softcap` c, the
    scores become c * tanh(scores / c) after the scale, before the mask and the softmax; with
    `sinks` [H] (gpt-oss), head h's softmax has one more logit, sinks[h], in its denominator and
    none in the output (attention that may rest on nothing). Every backend applies all three."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.sinks = sinks

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H, D]."""
        return meta.attend(self, q, k, v, kv_cache)

    def forward_qkv(self, qkv: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata) -> torch.Tensor:
        """From the fused q/k/v projection's output, rotary included; returns [T, H * D]."""
        return meta.attend_qkv(self, qkv, rope, kv_cache)
