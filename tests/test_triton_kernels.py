"""The Triton attention kernels (roseinfer/backends/triton/kernels.py) against a float64 torch
reference that gathers each sequence's K/V through its block table. Without a CUDA device they
run on CPU tensors in Triton's interpreter (tests/triton_interpret.py)."""
from __future__ import annotations

import math

import pytest
import torch

import triton_interpret

pytest.importorskip("triton")
triton_interpret.patch_interpreter()

from roseinfer.backends.triton import kernels

pytestmark = pytest.mark.triton
DEVICE = triton_interpret.device()
# fp16/bf16: inputs are rounded alike for the reference, but the kernels also round P before P @ V
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 1e-2},
       torch.bfloat16: {"atol": 2e-2, "rtol": 5e-2}}

# head_dim, num_heads, num_kv_heads, block_size, index dtype: G = 1, 2, 4, 8 and MQA (G = 8 and 3)
CASES = [
    (64, 2, 2, 16, torch.int32),
    (80, 4, 2, 32, torch.int64),
    (96, 8, 2, 16, torch.int64),
    (128, 8, 1, 64, torch.int32),
    (64, 16, 2, 32, torch.int32),
    (80, 3, 1, 16, torch.int64),
]
# prefill runs a program per query head, so fewer heads keep the interpreter quick: G = 1, 2, 4, 8
PREFILL_CASES = [
    (64, 2, 2, 16, torch.int32),
    (80, 4, 2, 32, torch.int64),
    (96, 4, 1, 16, torch.int64),
    (128, 8, 1, 64, torch.int32),
]


def case_ids(cases: list[tuple[int, int, int, int, torch.dtype]]) -> list[str]:
    return [f"d{d}-h{h}-kv{kv}-bs{bs}-{str(dtype)[6:]}" for d, h, kv, bs, dtype in cases]


def slots_of(block_table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    t = torch.arange(n)
    return block_table[t // block_size].long() * block_size + t % block_size


def make_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, index_dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache and block_tables (on CPU) with each sequence's tokens in shuffled blocks.
    Block 0 is never handed out and, like the unwritten tail of each last block, holds NaN: a
    kernel that reads past kv_len or through a padding block-table entry (0) returns NaN."""
    needed = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = 1 + sum(needed)
    order = 1 + torch.randperm(num_blocks - 1, generator=gen)
    block_tables = torch.zeros(len(kv_lens), max(needed) + 1, dtype=index_dtype)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, math.nan), torch.full(shape, math.nan)
    used = 0
    for i, (n, blocks) in enumerate(zip(kv_lens, needed)):
        block_tables[i, :blocks] = order[used:used + blocks]
        used += blocks
        slots = slots_of(block_tables[i], n, block_size)
        k_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    return k_cache, v_cache, block_tables


def fused_q(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, gen: torch.Generator,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q as the leading heads of a fused qkv projection's output: rows strided by (H + 2 Hkv) * D."""
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    return qkv[:, :num_heads * head_dim].view(num_rows, num_heads, head_dim)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float) -> torch.Tensor:
    """Causal attention of q [n, H, D] at positions first_position.. over k, v [n_keys, Hkv, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = first_position + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     kv_lens: list[int], block_size: int, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)  # kv_lens 0: zeros
    for i, n in enumerate(kv_lens):
        if n:
            slots = slots_of(block_tables[i], n, block_size)
            out[i] = reference(q[i:i + 1].cpu(), k_cache[slots], v_cache[slots], n - 1, scale)[0]
    return out


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_store_kv_writes_rows_and_skips_negative_slots(index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 80, 6
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    kv_width = num_kv_heads * head_dim
    k = qkv[:, num_heads * head_dim:][:, :kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, -kv_width:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([5, -1, 17, 40, -1, 63], dtype=index_dtype)
    k_cache = torch.randn(4 * 16, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(4 * 16, num_kv_heads, head_dim, generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    expected_k[slots[valid].long()] = k[valid]
    expected_v[slots[valid].long()] = v[valid]

    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    kernels.store_kv(k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), k_cache, v_cache)
    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size, index_dtype", CASES, ids=case_ids(CASES))
def test_decode_matches_reference(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                                  index_dtype: torch.dtype, num_splits: int) -> None:
    # 0: a padding row; 203 crosses 4 tiles and 4 to 13 blocks, and leaves the third of 3 splits empty
    kv_lens = [0, 1, 37, 203]
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, block_tables = make_cache(kv_lens, num_kv_heads, head_dim, block_size, index_dtype, gen)
    q = fused_q(len(kv_lens), num_heads, num_kv_heads, head_dim, gen)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                         torch.tensor(kv_lens, dtype=index_dtype, device=DEVICE), block_size, scale,
                                         num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = decode_reference(q, k_cache, v_cache, block_tables, kv_lens, block_size, scale)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_decode_long_context_with_the_most_splits_into_given_out() -> None:
    head_dim, num_heads, num_kv_heads, block_size = 64, 4, 2, 16
    kv_lens = [577, 64, 0]  # 37 blocks, 10 tiles: the 16 splits of the longest get one tile or none
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables = make_cache(kv_lens, num_kv_heads, head_dim, block_size, torch.int32, gen)
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    out = torch.full(q.shape, math.nan, device=DEVICE)
    returned = kernels.paged_decode_attention(q, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                              torch.tensor(kv_lens, device=DEVICE), block_size, 0.1, out=out,
                                              num_splits=kernels.MAX_SPLITS)
    assert returned is out
    expected = decode_reference(q, k_cache, v_cache, block_tables, kv_lens, block_size, 0.1)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_decode_default_splits() -> None:
    kv_lens = [300, 5]
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_tables = make_cache(kv_lens, 1, 64, 32, torch.int64, gen)
    q = torch.randn(len(kv_lens), 2, 64, generator=gen).to(DEVICE)
    out = kernels.paged_decode_attention(q, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                         torch.tensor(kv_lens, device=DEVICE), 32, 0.125)
    expected = decode_reference(q, k_cache, v_cache, block_tables, kv_lens, 32, 0.125)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_choose_num_splits() -> None:
    assert kernels.choose_num_splits(1, 8, 256, num_sms=132) == 1  # short contexts: never split
    assert kernels.choose_num_splits(1, 8, 32768, num_sms=132) == kernels.MAX_SPLITS
    assert kernels.choose_num_splits(4, 8, 4096, num_sms=132) == 9  # about two waves of 132 SMs
    assert kernels.choose_num_splits(64, 8, 32768, num_sms=132) == 1  # the batch fills the GPU alone


def run_prefill(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, index_dtype: torch.dtype,
                chunks: list[tuple[int, int]], seed: int, max_q_len: int | None = None,
                dtype: torch.dtype = torch.float32) -> None:
    """chunks: (q_len, kv_len) per sequence, laid out in q with one foreign row (say, a decode)
    after each chunk; those rows of out must be left alone."""
    q_lens = [q_len for q_len, _ in chunks]
    kv_lens = [kv_len for _, kv_len in chunks]
    q_starts = [sum(q_lens[:i]) + i for i in range(len(chunks))]
    num_rows = sum(q_lens) + len(chunks)
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_cache(kv_lens, num_kv_heads, head_dim, block_size, index_dtype, gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = fused_q(num_rows, num_heads, num_kv_heads, head_dim, gen, dtype)
    out = torch.full((num_rows, num_heads, head_dim), -7.0, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=index_dtype, device=DEVICE)

    kernels.paged_prefill_attention(q, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                    index(q_starts), index(q_lens), index(kv_lens), block_size, scale, out,
                                    max_q_len=max_q_len)
    expected = torch.full(out.shape, -7.0, dtype=torch.float64)
    for i, (start, q_len, kv_len) in enumerate(zip(q_starts, q_lens, kv_lens)):
        slots = slots_of(block_tables[i], kv_len, block_size)
        rows = slice(start, start + q_len)
        expected[rows] = reference(q[rows].cpu(), k_cache[slots], v_cache[slots], kv_len - q_len, scale)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size, index_dtype", PREFILL_CASES,
                         ids=case_ids(PREFILL_CASES))
def test_prefill_matches_reference(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                                   index_dtype: torch.dtype) -> None:
    chunks = [
        (70, 70),  # a whole prompt: 2 query tiles, 2 key tiles
        (5, 5),  # a short whole prompt
        (30, 100),  # a chunk behind earlier chunks
        (69, 133),  # behind a 64-token prefix-cache hit: the tiles straddle the causal limit
    ]
    run_prefill(head_dim, num_heads, num_kv_heads, block_size, index_dtype, chunks, seed=4)


def test_prefill_with_max_q_len() -> None:
    run_prefill(64, 6, 2, 16, torch.int32, [(1, 40), (17, 17), (66, 80)], seed=5, max_q_len=66)  # G = 3


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter's tl.dot "
                                                          "multiplies bf16 operands as their raw uint16 bits")),
], ids=["fp16", "bf16"])
def test_half_precision_keeps_its_dtype(dtype: torch.dtype) -> None:
    kv_lens = [150, 0, 33]
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, block_tables = make_cache(kv_lens, 2, 80, 16, torch.int32, gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = fused_q(len(kv_lens), 4, 2, 80, gen, dtype)
    out = kernels.paged_decode_attention(q, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                                         torch.tensor(kv_lens, device=DEVICE), 16, 0.1, num_splits=2)
    assert out.dtype == dtype
    expected = decode_reference(q, k_cache, v_cache, block_tables, kv_lens, 16, 0.1)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])
    run_prefill(80, 4, 2, 16, torch.int64, [(70, 70), (20, 90)], seed=7, dtype=dtype)
