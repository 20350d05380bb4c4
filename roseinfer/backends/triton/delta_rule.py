"""The gated delta rule (layers/gated_delta_rule.py) in Triton, fused recurrent: one program per
(sequence, value head, tile of value columns) keeps its [Dk, BLOCK_V] slice of the state in
registers, reads it from the state pool once, steps through the sequence's tokens in order and
writes it back in place; decode is the one-token case of the same kernel.

Prefill runs token by token too (flash-linear-attention's fused_recurrent form), not the chunked
UT-transform form: each step is a rank-1 update of a tile that never leaves the registers, and the
state pool is read and written once per chunk either way. q and k arrive as the model hands them
(models/qwen3_5.py `_heads`): L2-normalised, q scaled by Dk^-0.5, key heads already repeated up to
the value heads; the state is float32 whatever the model's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value columns per program: a [Dk, 32] fp32 tile stays in registers up to Dk = 256


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, keep_ptr, lens_ptr, out_ptr,
                       stride_q_seq, stride_q_tok, stride_q_head, stride_k_seq, stride_k_tok, stride_k_head,
                       stride_v_seq, stride_v_tok, stride_v_head, stride_g_seq, stride_g_tok,
                       stride_o_seq, stride_o_tok, stride_o_head, stride_s_slot, stride_s_head,
                       k_dim, v_dim, padded_length, HAS_LENS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S, per token, on the state tile
    # S[:, columns] of head `head` of sequence `seq`, whose columns are independent of the others'.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    columns = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_mask, column_mask = rows < k_dim, columns < v_dim
    tile_mask = row_mask[:, None] & column_mask[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile_ptrs = states_ptr + slot * stride_s_slot + head * stride_s_head + rows[:, None] * v_dim + columns[None, :]
    # a sequence at position 0 starts from zeros whatever its slot holds (a finished request's state)
    keep = tl.load(keep_ptr + seq)
    state = tl.where(keep != 0, tl.load(tile_ptrs, mask=tile_mask, other=0.0).to(tl.float32), 0.0)
    if HAS_LENS:
        length = tl.load(lens_ptr + seq).to(tl.int32)
    else:
        length = padded_length
    for t in range(length):
        q = tl.load(q_ptr + seq * stride_q_seq + t * stride_q_tok + head * stride_q_head + rows,
                    mask=row_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + seq * stride_k_seq + t * stride_k_tok + head * stride_k_head + rows,
                    mask=row_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + seq * stride_v_seq + t * stride_v_tok + head * stride_v_head + columns,
                    mask=column_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + seq * stride_g_seq + t * stride_g_tok + head).to(tl.float32)
        beta = tl.load(beta_ptr + seq * stride_g_seq + t * stride_g_tok + head).to(tl.float32)
        state = state * tl.exp(g)
        correction = (v - tl.sum(k[:, None] * state, axis=0)) * beta
        state = state + k[:, None] * correction[None, :]
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(out_ptr + seq * stride_o_seq + t * stride_o_tok + head * stride_o_head + columns, o,
                 mask=column_mask)
    tl.store(tile_ptrs, state.to(states_ptr.dtype.element_ty), mask=tile_mask)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    # the conv's prefill output is channel-strided (token-major memory): a vector load wants it dense
    return t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def gated_delta_rule_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                      lens: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule on the state pool in place. q, k [n, L, H, Dk], v [n, L, H, Dv], g, beta
    [n, L, H] (right-padded; lens [n] the tokens of each, all L where None); states [slots, H, Dk, Dv]
    with contiguous [Dk, Dv] planes, sequence i's at slots[i], taken as zeros where keep[i] is 0.
    Returns o [n, L, H, Dv] in float32, the padding rows unwritten."""
    n, length, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    q, k, v, g, beta = (_rows_contiguous(t) for t in (q, k, v, g, beta))
    if states.stride(-1) != 1 or states.stride(-2) != v_dim:
        raise ValueError("each head's state must be a contiguous [Dk, Dv] plane of the pool")
    if g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(n, length, heads, v_dim, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    grid = (n, heads, triton.cdiv(v_dim, BLOCK_V))
    _delta_rule_kernel[grid](
        q, k, v, g, beta, states, slots, keep, lens if lens is not None else slots, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        out.stride(0), out.stride(1), out.stride(2), states.stride(0), states.stride(1),
        k_dim, v_dim, length, HAS_LENS=lens is not None, BLOCK_K=max(16, triton.next_power_of_2(k_dim)),
        BLOCK_V=BLOCK_V)
    return out
