"""Multi-head latent attention (DeepSeek-V2 / V3), with the up-projections absorbed.

Each token's keys and values come from one compressed latent c (kv_lora_rank wide, RMS-normed) and
one rotated key k_pe shared by every head (qk_rope_head_dim); transformers expands c through
kv_b_proj into per-head k_nope and v. Here the KV pool keeps only [c | k_pe] per token, and the
expansion is never made: W_UK (kv_b_proj's key rows) is folded into the query,
q_nope . (W_UK c) = (W_UK^T q_nope) . c, and W_UV (its value rows) applied after attention,
sum_j p_j W_UV c_j = W_UV sum_j p_j c_j. Attention is then multi-query attention of H query heads
of width kv_lora_rank + qk_rope_head_dim over one KV head, which every backend's paged attention
computes as it is: the "value" is that same cached row, of which the first kv_lora_rank columns
of the output are kept (the rope columns' share of the output is wasted work, 64 of 576 columns
for DeepSeek-V3). vLLM and SGLang absorb in decode only; doing it in prefill too keeps one path.
"""
from __future__ import annotations

import torch
from torch import nn

from typing import Callable

from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention
from roseinfer.layers.linear import Linear
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.deepseek_layouts import MlaLayout

LinearBuilder = Callable[[int, int, bool], Linear]  # (in_features, out_features, bias) -> the layer held


class LatentUpProjection(nn.Module):
    """kv_b_proj's weight, [H * (qk_nope + v), kv_lora_rank] as the checkpoint has it (under tensor
    parallelism this rank's heads' rows, which the model names in `tp_parts` for the weight loader),
    never run as a matmul on the latent: a plain parameter, so no backend swaps it for a prepacked
    linear."""

    def __init__(self, num_heads: int, mla: MlaLayout) -> None:
        super().__init__()
        self.num_heads, self.mla = num_heads, mla
        self.weight = nn.Parameter(torch.empty(num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                               mla.kv_lora_rank))

    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_head = self.weight.view(self.num_heads, -1, self.mla.kv_lora_rank)
        return per_head[:, :self.mla.qk_nope_head_dim], per_head[:, self.mla.qk_nope_head_dim:]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope] -> [T, H, kv_lora_rank]: W_UK^T q_nope per head."""
        return torch.bmm(q_nope.transpose(0, 1), self._per_head()[0]).transpose(0, 1)

    def values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] -> [T, H, v_head_dim]: W_UV per head."""
        return torch.bmm(latent_out.transpose(0, 1), self._per_head()[1].transpose(1, 2)).transpose(0, 1)


class MultiHeadLatentAttention(nn.Module):
    """The checkpoint's names: q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj. Rotary pairs are adjacent, as DeepSeek lays them out
    (layers/rotary.py); the model reorders a halves-layout checkpoint's rows at load.

    `heads_out` and `heads_in` build the projections whose rows (q) or columns (o) are per head, from
    the whole projection's (in_features, out_features, bias): plain Linears by default; under tensor
    parallelism the model's builders keep this rank's heads (o's output is then a partial sum for the
    model's all-reduce), and the latent's projections stay whole, each rank caching the same row."""

    def __init__(self, hidden_size: int, num_heads: int, mla: MlaLayout, scale: float, eps: float,
                 bias: bool, heads_out: LinearBuilder = Linear, heads_in: LinearBuilder = Linear) -> None:
        super().__init__()
        self.mla = mla
        q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = q = heads_out(hidden_size, num_heads * q_head, False)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
            self.q_b_proj = q = heads_out(mla.q_lora_rank, num_heads * q_head, False)
        self.num_heads = q.out_features // q_head  # this rank's
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.cache_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = LatentUpProjection(self.num_heads, mla)
        self.o_proj = heads_in(num_heads * mla.v_head_dim, hidden_size, bias)
        self.attn = PagedAttention(self.num_heads, 1, mla.cache_width, scale)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
                ) -> torch.Tensor:
        tokens, mla = x.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj.forward(x)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa.forward(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm.forward(latent.contiguous())
        # rotate() may work in place on a fresh tensor: contiguous copies, not views into q or the projection
        q_pe = meta.rotate(q_pe.contiguous(), rope)
        k_pe = meta.rotate(k_pe.contiguous().view(tokens, 1, mla.qk_rope_head_dim), rope)
        query = torch.cat([self.kv_b_proj.absorb_query(q_nope), q_pe], dim=-1)
        row = torch.cat([latent.view(tokens, 1, mla.kv_lora_rank), k_pe], dim=-1)
        out = self.attn(query, row, row, kv_cache, meta)  # K and V are the one cached row
        values = self.kv_b_proj.values(out[..., :mla.kv_lora_rank])
        return self.o_proj.forward(values.reshape(tokens, self.num_heads * mla.v_head_dim))
