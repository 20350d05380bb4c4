"""Triton kernels of the `triton` attention backend: the KV-cache write, decode attention over the
paged cache (split-KV, "flash decoding") and causal prefill attention over it.

The cache of one layer is k_cache, v_cache [num_blocks * block_size, num_kv_heads, head_dim];
token t of a sequence lives in slot block_table[t // block_size] * block_size + t % block_size.
Query head h reads KV head h // G, G = num_heads // num_kv_heads. Every row of q, k, v and the
caches must have its head dim contiguous; rows and heads may be strided (q may be a view of a
fused qkv projection). Index tensors may be int32 or int64: the kernels widen them to int64
before forming addresses. A head dim that is not a power of two runs in the next power of two
with the tail masked off. Softmax is computed in base 2 (exp2 of scores pre-scaled by log2(e))
with fp32 statistics and accumulators; outputs are written in their tensor's dtype.
A layer's sliding window W (layers/attention.py: the query at position p sees p - W < t <= p) is a
kernel argument (ALL_KEYS where none), so no tile wholly before a window is read; its logit soft-cap
(cap * tanh(scores / cap), after the scale) is a compile-time branch of the score tile. Its sinks
(one logit per query head, counted in the softmax's denominator only) start each row's online
softmax: the running max at the sink and the sum at 1, in the first split of a decode only.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
# Keys per tile. Tiles gather their slots through the block table, so they need not match the block size.
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
# Split-KV: no split gets fewer keys than this of the longest context the block tables can hold,
# and no (sequence, KV head) more splits than MAX_SPLITS (the merge reads them all at once).
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16
# The window of a layer that attends to the whole context: wider than any context (int32 arithmetic).
ALL_KEYS = 2**30


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                     stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_c_slot, stride_c_head,
                     num_kv_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: its [Hkv, D] K and V rows go to its cache slot. A slot < 0 marks a
    # padding row (CUDA-graph batches) and is masked out rather than branched on: it has no valid
    # heads. (A scalar & a tensor mask makes an int32 mask that Triton 3.9's interpreter refuses.)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < tl.where(slot >= 0, num_kv_heads, 0)) & (dims < head_dim)
    dst = slot * stride_c_slot + heads * stride_c_head + dims
    k = tl.load(k_ptr + row * stride_k_row + heads * stride_k_head + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + row * stride_v_row + heads * stride_v_head + dims, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_kv_tile(block_table, keys, key_mask, d, kv_head, stride_c_slot, stride_c_head, head_dim,
                   BLOCK_SIZE: tl.constexpr):
    # Where the keys' K/V rows of one KV head sit in the pool: through the block table, a key at a time.
    blocks = tl.load(block_table + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    slots = blocks * BLOCK_SIZE + keys % BLOCK_SIZE
    offsets = slots[:, None] * stride_c_slot + kv_head * stride_c_head + d[None, :]
    return offsets, key_mask[:, None] & (d < head_dim)[None, :]


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), tanh from exp2 (the interpreter has no libdevice): tanh|x| = (1 - t) / (1 + t)
    # with t = e^(-2|x|) in (0, 1], which never overflows; 2.885... is 2 log2(e)
    t = tl.exp2(-2.8853900817779268 * tl.abs(s) / cap)
    magnitude = cap * (1.0 - t) / (1.0 + t)
    return tl.where(s < 0, -magnitude, magnitude)


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, kv_mask, score_mask, m, row_sum, acc, qk_scale, softcap,
                 SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # One K/V tile of online softmax (exp2: qk_scale carries log2 e): the running max m, sum row_sum and
    # output acc of each query row, updated with the tile's scores where score_mask allows them. With
    # SOFTCAP, qk_scale is the layer's plain scale: the cap applies to natural-unit scores, then log2 e.
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = _soft_cap(s, softcap) * 1.4426950408889634
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, row_sum * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   qk_scale, window, softcap, sinks_ptr, stride_q_row, stride_q_head, stride_c_slot, stride_c_head,
                   stride_bt_row, stride_o_row, stride_o_head, num_heads, head_dim, num_splits,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    # Program (sequence, KV head, split): the G query heads that share the KV head, over this
    # split's slice of the context. The heads are the M side of tl.dot, padded to BLOCK_G >= 16
    # (the smallest dot tile): each K/V tile is loaded once for the whole group, and the padding
    # only costs tensor-core arithmetic in a kernel bound by memory. The context is cut into
    # num_splits equal slices, whole tiles each, so long contexts spread over more programs;
    # without SPLIT the one split writes the output itself, otherwise the merge kernel does. The
    # slices cover the window: the last `window` keys.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    first_key = tl.maximum(kv_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(kv_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    start = first_key + split * split_len
    end = tl.minimum(start + split_len, kv_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    hd_mask = (g < GROUP)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq * stride_q_row + heads[:, None] * stride_q_head + d[None, :], mask=hd_mask, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # in the first split only: the merge then counts each sink once
        sink_heads = g < tl.where(split == 0, GROUP, 0)
        m = tl.load(sinks_ptr + heads, mask=sink_heads, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        row_sum = tl.where(sink_heads, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_row
    # an empty split (start >= end: a short or zero-length context) reads nothing, not even its block table
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        offsets, kv_mask = _paged_kv_tile(block_table, keys, key_mask, d, kv_head, stride_c_slot, stride_c_head,
                                          head_dim, BLOCK_SIZE)
        m, row_sum, acc = _attend_tile(q, k_cache_ptr + offsets, v_cache_ptr + offsets, kv_mask, key_mask[None, :],
                                       m, row_sum, acc, qk_scale, softcap, SOFTCAP, DOT_PRECISION)

    o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # nothing attended (empty split or kv_len 0): zeros
    if SPLIT:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * head_dim + d[None, :], o, mask=hd_mask)
        lse = tl.where(row_sum > 0, m + tl.log2(tl.where(row_sum > 0, row_sum, 1.0)),
                       float("-inf"))  # empty: weighs nothing
        tl.store(part_lse_ptr + part, lse, mask=g < GROUP)
    else:
        dst = out_ptr + seq * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_o_row, stride_o_head, num_heads, head_dim,
                         num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (sequence, query head): each split left its normalised output and the base-2
    # log-sum-exp of its scores; weighting the outputs by 2^(lse - max lse) rebuilds the softmax
    # over the whole context. Empty splits carry lse = -inf and weigh nothing.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (seq * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty (kv_len 0): zeros
    w = tl.exp2(lse - lse_max)
    mask = (s < num_splits)[:, None] & (d < head_dim)[None, :]
    parts = tl.load(part_out_ptr + part[:, None] * head_dim + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_row + head * stride_o_head + d, o.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr, out_ptr,
                    qk_scale, window, softcap, sinks_ptr, stride_q_row, stride_q_head, stride_c_slot, stride_c_head,
                    stride_bt_row, stride_o_row, stride_o_head, head_dim,
                    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (query tile, query head, sequence): BLOCK_M consecutive queries of one sequence's
    # chunk and one head, flash-attention style over the cached keys in BLOCK_N tiles. The chunk
    # sits at the end of the context (earlier chunks and prefix-cache hits before it), so query
    # row r is at position kv_len - q_len + r; the key loop stops at the tile's last position,
    # skipping every tile past the causal limit, and starts at the tile's first row's window.
    # Programs past a sequence's q_len exit at once
    # (the grid is sized for the longest chunk). One head per program keeps the tile square;
    # the G heads of a group read the same K/V tiles, which mostly come from L2.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = (rows < q_len)[:, None] & (d < head_dim)[None, :]
    positions = kv_len - q_len + tl.minimum(rows, q_len - 1)  # padding rows repeat the last row
    q_rows = (q_start + rows)[:, None]
    q = tl.load(q_ptr + q_rows * stride_q_row + head * stride_q_head + d[None, :], mask=row_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        row_sum = row_sum + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_row
    # Each row sees its own key, so no row's max stays -inf.
    key_end = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
    key_begin = tl.maximum(kv_len - q_len + tile * BLOCK_M - window + 1, 0)
    for tile_start in range(key_begin, key_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        offsets, kv_mask = _paged_kv_tile(block_table, keys, key_mask, d, kv_head, stride_c_slot, stride_c_head,
                                          head_dim, BLOCK_SIZE)
        visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)
        m, row_sum, acc = _attend_tile(q, k_cache_ptr + offsets, v_cache_ptr + offsets, kv_mask,
                                       key_mask[None, :] & visible, m, row_sum, acc, qk_scale, softcap, SOFTCAP,
                                       DOT_PRECISION)

    o = acc / row_sum[:, None]
    tl.store(out_ptr + q_rows * stride_o_row + head * stride_o_head + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_mask)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 caches would otherwise be multiplied in TF32 on the GPU (10-bit mantissa); fp16/bf16 take the default
    return "ieee" if dtype == torch.float32 else None


def _check_rows(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 3 or (t.shape[2] > 1 and t.stride(2) != 1):
            raise ValueError(f"{name} must be [rows, heads, head_dim] with head_dim contiguous, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Returns G, the query heads per KV head."""
    _check_rows(q=q, k_cache=k_cache, v_cache=v_cache)
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    return q.shape[1] // k_cache.shape[1]


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] and v_cache[slot_mapping[t]] = v[t] for every row t of
    k, v [T, Hkv, D]; rows whose slot is negative are skipped."""
    _check_rows(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) for decode: enough programs for about two waves over the
    GPU's SMs, but no split shorter than MIN_SPLIT_KEYS keys of the longest possible context."""
    by_length = max(1, max_context // MIN_SPLIT_KEYS)
    by_occupancy = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    # Under TRITON_INTERPRET=1 (CPU tensors) programs run one after another: splitting gains nothing.
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _score_args(scale: float, sliding_window: int | None, logit_softcap: float | None, sinks: torch.Tensor | None,
                q: torch.Tensor) -> dict:
    """The kernels' scale, window, soft-cap and sinks arguments for a layer's options (module
    docstring); without sinks, q stands in for their pointer, never read."""
    return {"qk_scale": scale if logit_softcap else scale * LOG2E, "window": sliding_window or ALL_KEYS,
            "softcap": logit_softcap or 0.0, "SOFTCAP": bool(logit_softcap),
            "sinks_ptr": q if sinks is None else sinks, "SINKS": sinks is not None}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           kv_lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, sliding_window: int | None = None,
                           logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, q [B, H, D]: sequence i attends to its first kv_lens[i] cached tokens
    (its new token already stored), or the last sliding_window of them, through block_tables
    [B, max_blocks]; logit_softcap and sinks ([H], contiguous) as PagedAttention's. Rows with kv_lens
    0 give zeros (without sinks). Writes and returns out [B, H, D] (allocated when None). num_splits (default: from the
    batch, the block-table width and the GPU) cuts each context into that many slices run by
    separate programs and merged after; it depends on shapes only, never on kv_lens' values, so
    the launch needs no device sync and can be captured in a CUDA graph."""
    group = _check_attention_args(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, _num_sms(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    split = num_splits > 1
    if split:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # not touched when there is a single split
    block_d = _block_d(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, kv_lens, out, part_out, part_lse,
        stride_q_row=q.stride(0), stride_q_head=q.stride(1), stride_c_slot=k_cache.stride(0),
        stride_c_head=k_cache.stride(1), stride_bt_row=block_tables.stride(0), stride_o_row=out.stride(0),
        stride_o_head=out.stride(1), num_heads=num_heads, head_dim=head_dim, num_splits=num_splits,
        GROUP=group, BLOCK_SIZE=block_size, SPLIT=split, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype),
        **_score_args(scale, sliding_window, logit_softcap, sinks, q))
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, head_dim, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                            scale: float, out: torch.Tensor, max_q_len: int | None = None,
                            sliding_window: int | None = None, logit_softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> None:
    """Causal attention for prompt chunks: sequence i's queries are rows q_starts[i] .. + q_lens[i] - 1
    of q [T, H, D], at the last q_lens[i] of its kv_lens[i] cached positions (this chunk's K/V
    already stored), within sliding_window, soft-capped by logit_softcap, with sinks ([H]). Writes those rows of out [T, H, D]; other rows are left alone. max_q_len, an
    upper bound on q_lens known to the caller, trims the grid; without it the grid assumes T."""
    group = _check_attention_args(q, k_cache, v_cache)
    _check_rows(out=out)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = q_lens.shape[0]
    longest = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    if num_seqs == 0 or longest == 0:
        return
    _prefill_kernel[(triton.cdiv(longest, PREFILL_BLOCK_M), num_heads, num_seqs)](
        q, k_cache, v_cache, block_tables, q_starts, q_lens, kv_lens, out,
        stride_q_row=q.stride(0), stride_q_head=q.stride(1), stride_c_slot=k_cache.stride(0),
        stride_c_head=k_cache.stride(1), stride_bt_row=block_tables.stride(0), stride_o_row=out.stride(0),
        stride_o_head=out.stride(1), head_dim=head_dim,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
        BLOCK_D=_block_d(head_dim), DOT_PRECISION=_dot_precision(q.dtype),
        **_score_args(scale, sliding_window, logit_softcap, sinks, q))
