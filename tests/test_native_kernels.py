"""The CPU backend's C kernels (backends/cpu/csrc) against the torch ops they replace (their build,
bindings and fallback: tests/test_kernel_build.py)."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from roseinfer.backends.base import BatchLayout
from roseinfer.backends.cpu import CPUBackend, ops
from roseinfer.backends.torch_sdpa import TorchBackend
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.rotary import apply_rotary

CPU = torch.device("cpu")
HAS_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler: the native kernels cannot be built")


def _paged_case(seed: int, heads: int, kv_heads: int, head_dim: int, lens: list[int], block_size: int = 4):
    """A pool with each sequence's blocks scattered at random, and one query row per sequence
    taken as a strided view (as the model's q is a slice of the qkv projection)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 5
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g) * 3
    return qkv[:, :heads], k_cache, v_cache, tables.contiguous(), torch.tensor(lens)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (8, 2, 128), (4, 4, 40), (9, 3, 16)])
def test_paged_decode_attention_matches_gather_and_sdpa(heads: int, kv_heads: int, head_dim: int) -> None:
    lens = [1, 5, 17, 33, 8]
    q, k_cache, v_cache, tables, kv_lens = _paged_case(0, heads, kv_heads, head_dim, lens)
    scale = head_dim ** -0.5
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, kv_lens, 4, scale)
    for i, length in enumerate(lens):  # reference: each sequence's tokens in order, plain SDPA with GQA
        slots = torch.tensor([int(tables[i, t // 4]) * 4 + t % 4 for t in range(length)])
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [Hkv, L, D]
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, values, scale=scale,
                                             enable_gqa=heads != kv_heads).squeeze(1)
        torch.testing.assert_close(got[i], ref, rtol=1e-5, atol=1e-5)
    # fewer rows than threads split each row's heads between them: the same bits however many
    threads = torch.get_num_threads()
    try:
        for rows, count in ((1, 1), (1, 3), (2, 4), (5, 16)):
            torch.set_num_threads(count)
            alone = ops.paged_decode_attention(q[:rows], k_cache, v_cache, tables[:rows], kv_lens[:rows], 4, scale)
            assert torch.equal(alone, got[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_attention_kernels_refuse_index_and_cache_tensors_they_would_read_past() -> None:
    """An int32 table or a strided one would be read as int64 rows past its end: a TypeError naming
    it, before the kernel runs."""
    q, k_cache, v_cache, tables, kv_lens = _paged_case(0, 4, 2, 16, [3, 9])
    with pytest.raises(TypeError, match="block_tables must be a contiguous torch.int64 tensor, got a torch.int32"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables.int(), kv_lens, 4, 0.25)
    with pytest.raises(TypeError, match="kv_lens must be a contiguous torch.int64 tensor, got a strided"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.stack([kv_lens, kv_lens], 1)[:, 0], 4, 0.25)
    with pytest.raises(TypeError, match="k_cache must be a contiguous torch.float32 tensor, got a torch.float64"):
        ops.paged_decode_attention(q, k_cache.double(), v_cache, tables, kv_lens, 4, 0.25)
    with pytest.raises(TypeError, match="q must be a torch.float32 tensor, got a torch.bfloat16"):
        ops.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, kv_lens, 4, 0.25)
    with pytest.raises(TypeError, match="q_lens must be a contiguous torch.int64"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 1]),
                                    torch.tensor([1, 1], dtype=torch.int32), kv_lens, 4, 0.25, torch.empty(2, 4, 16))
    with pytest.raises(TypeError, match="slots must be a contiguous torch.int64"):
        ops.store_kv(k_cache[:2], v_cache[:2], torch.tensor([0, 1], dtype=torch.int32), k_cache, v_cache)
    with pytest.raises(TypeError, match="ids must be a contiguous torch.int64"):
        ops.dequantize_rows(torch.zeros(4, 34, dtype=torch.uint8), 8, torch.tensor([0], dtype=torch.int32), 32)


def _causal_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, start: int,
                      q_len: int, kv_len: int, block_size: int, scale: float) -> torch.Tensor:
    """One chunk's rows through plain SDPA: its queries sit at the last q_len of kv_len positions."""
    slots = torch.tensor([int(table[t // block_size]) * block_size + t % block_size for t in range(kv_len)])
    keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [Hkv, L, D]
    positions = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
    mask = torch.zeros(q_len, kv_len).masked_fill_(torch.arange(kv_len) > positions, float("-inf"))
    out = F.scaled_dot_product_attention(q[start:start + q_len].transpose(0, 1), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1])
    return out.transpose(0, 1)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16), (8, 1, 32), (6, 2, 96)])
def test_paged_prefill_attention_matches_sdpa_under_a_causal_mask(heads: int, kv_heads: int, head_dim: int) -> None:
    """Whole prompts and later chunks (context already cached) of assorted lengths, several longer
    than one task's tile of rows, in one call; q is a strided view and the rows between chunks (a
    decode row's, say) are left as they were."""
    block_size = 4
    q_lens, contexts = [32, 5, 70, 2, 23], [0, 0, 13, 40, 9]
    kv_lens = [c + n for c, n in zip(contexts, q_lens)]
    _, k_cache, v_cache, tables, _ = _paged_case(3, heads, kv_heads, head_dim, kv_lens, block_size)
    starts = [1 + sum(q_lens[:i]) + i for i in range(len(q_lens))]  # one foreign row before each chunk
    rows = starts[-1] + q_lens[-1]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim) * 3
    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    out = torch.full((rows, heads, head_dim), 7.0)
    scale = head_dim ** -0.5
    ops.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(starts), torch.tensor(q_lens),
                                   torch.tensor(kv_lens), block_size, scale, out)
    written = torch.zeros(rows, dtype=torch.bool)
    for i, (start, q_len) in enumerate(zip(starts, q_lens)):
        expected = _causal_reference(q, k_cache, v_cache, tables[i], start, q_len, kv_lens[i], block_size, scale)
        torch.testing.assert_close(out[start:start + q_len], expected, rtol=1e-5, atol=1e-5)
        written[start:start + q_len] = True
    assert (out[~written] == 7.0).all()


@needs_kernels
def test_paged_prefill_attention_refuses_shapes_its_vector_loops_do_not_cover() -> None:
    assert not ops.prefill_attention_supported(40, 1) and not ops.prefill_attention_supported(256, 1)
    # more query heads per KV head than a task has lanes: not even one query row would fit
    assert ops.prefill_attention_supported(64, 64) and not ops.prefill_attention_supported(64, 65)
    q = torch.randn(3, 2, 40)
    cache = torch.zeros(8, 2, 40)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.paged_prefill_attention(q, cache, cache, torch.tensor([[0, 1]]), one, torch.tensor([3]),
                                       torch.tensor([3]), 4, 0.1, torch.empty(3, 2, 40))
    with pytest.raises(ValueError, match="query heads per KV head"):
        ops.paged_prefill_attention(torch.randn(3, 65, 16), torch.zeros(8, 1, 16), torch.zeros(8, 1, 16),
                                       torch.tensor([[0, 1]]), one, torch.tensor([3]), torch.tensor([3]), 4, 0.1,
                                       torch.empty(3, 65, 16))


@needs_kernels
def test_cpu_and_torch_backends_attend_alike_through_the_layer() -> None:
    """One decode step of five sequences through PagedAttention with each backend's metadata: the CPU
    backend's (store_kv + the kernel) against the torch backend's (index_copy_ + gather + SDPA)."""
    heads, kv_heads, head_dim, block_size = 6, 2, 32, 4
    lens = [3, 9, 16, 21, 2]
    q, k_cache, v_cache, tables, kv_lens = _paged_case(1, heads, kv_heads, head_dim, lens, block_size)
    k, v = torch.randn(len(lens), kv_heads, head_dim), torch.randn(len(lens), kv_heads, head_dim)
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    layout = BatchLayout(block_size, [0] * len(lens), [n - 1 for n in lens], slots, list(range(len(lens))),
                         [1] * len(lens), lens, tables.tolist())
    shape = SimpleNamespace(head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads)
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    outs, caches = [], []
    for backend in (TorchBackend, CPUBackend):
        cache = (k_cache.clone(), v_cache.clone())
        outs.append(attention(q, k, v, cache, backend(CPU, torch.float32, shape).build_metadata(layout)))
        caches.append(cache)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert torch.equal(caches[1][0][torch.tensor(slots)], k)


@needs_kernels
def test_short_chunks_attend_as_decode_rows_and_match_the_torch_backend() -> None:
    """A step of a decode, a 3-row chunk (a speculative verification: 3 x 3 query heads per KV head
    fill few of the prefill kernel's 64 lanes) and a 30-row chunk (90 lanes): the short chunk goes
    to the decode kernel row by row, each row seeing the chunk's earlier rows, the long one to the
    prefill kernel, and the step attends as the torch backend's does."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 4
    lens, q_lens = [11, 20, 37], [1, 3, 30]
    _, k_cache, v_cache, tables, _ = _paged_case(3, heads, kv_heads, head_dim, lens, block_size)
    rows = sum(q_lens)
    q = torch.randn(rows, heads, head_dim)
    k, v = torch.randn(rows, kv_heads, head_dim), torch.randn(rows, kv_heads, head_dim)
    positions = [p for n, m in zip(lens, q_lens) for p in range(n - m, n)]
    owners = [i for i, m in enumerate(q_lens) for _ in range(m)]
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size for i, p in zip(owners, positions)]
    layout = BatchLayout(block_size, [0] * rows, positions, slots, [0, 1, 4], q_lens, lens, tables.tolist())
    shape = SimpleNamespace(head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads)
    metadata = CPUBackend(CPU, torch.float32, shape).build_metadata(layout)
    decode_rows = metadata.groups[0]
    assert decode_rows.output_rows.tolist() == [0, 1, 2, 3] and decode_rows.kv_lens.tolist() == [11, 18, 19, 20]
    assert not metadata.fused_decode and len(metadata.groups) == 2  # the long chunk needs the layer path
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    outs = [attention(q, k, v, (k_cache.clone(), v_cache.clone()), m)
            for m in (TorchBackend(CPU, torch.float32, shape).build_metadata(layout), metadata)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 40)])
@pytest.mark.parametrize("rows_per_seq", [[1, 1, 1, 1, 1], [1, 4, 1, 3, 2]], ids=["decodes", "chunks"])
def test_fused_decode_equals_rotary_store_and_attention_one_after_another(heads: int, kv_heads: int, head_dim: int,
                                                                         rows_per_seq: list[int]) -> None:
    """decode_attention_qkv against the three calls it replaces: the same output, cache and rotated
    qkv bit for bit, with each new token written to its slot and attended to in the same call. With
    chunks, a sequence has several rows (its last tokens, as a speculative verification has): each
    row must see the rows before it, so every row's K/V is in the cache before any row attends."""
    block_size, lens = 4, [3, 9, 16, 21, 2]
    _, k_cache, v_cache, tables, _ = _paged_case(7, heads, kv_heads, head_dim, lens, block_size)
    rows = [(i, p) for i, (m, r) in enumerate(zip(lens, rows_per_seq)) for p in range(m - r, m)]
    n, q_width, kv_width = len(rows), heads * head_dim, kv_heads * head_dim
    row_tables = tables[torch.tensor([i for i, _ in rows])].contiguous()
    kv_lens = torch.tensor([p + 1 for _, p in rows])
    qkv = torch.randn(n, q_width + 2 * kv_width) * 3
    rotations = torch.polar(torch.ones(n, 1, head_dim // 2), torch.randn(n, 1, head_dim // 2) * 50)
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for i, p in rows])
    separate_qkv, separate_cache = qkv.clone(), (k_cache.clone(), v_cache.clone())
    qk = separate_qkv[:, :q_width + kv_width].view(n, heads + kv_heads, head_dim)
    ops.rotary_(qk, rotations)
    ops.store_kv(qk[:, heads:], separate_qkv[:, q_width + kv_width:].view(n, kv_heads, head_dim), slots,
                    *separate_cache)
    expected = ops.paged_decode_attention(qk[:, :heads], *separate_cache, row_tables, kv_lens, block_size,
                                             head_dim ** -0.5)
    got = ops.decode_attention_qkv(qkv, rotations, slots, k_cache, v_cache, row_tables, kv_lens, block_size,
                                      heads, head_dim ** -0.5)
    assert torch.equal(got, expected.view(n, q_width))
    assert torch.equal(qkv, separate_qkv)
    assert torch.equal(k_cache, separate_cache[0]) and torch.equal(v_cache, separate_cache[1])
    assert torch.equal(k_cache[slots].flatten(1), qkv[:, q_width:q_width + kv_width])


@needs_kernels
@pytest.mark.parametrize("dim", [64, 576, 37])
def test_rms_norm_matches_torch_with_and_without_residual(dim: int) -> None:
    torch.manual_seed(2)
    wide = torch.randn(9, dim + 8) * 4
    x = wide[:, :dim]  # rows with a stride, as slices of a wider tensor are
    weight, residual = torch.randn(dim), torch.randn(9, dim)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5))
    stream = residual.clone()
    normed = ops.rms_norm(x, weight, 1e-6, stream)
    torch.testing.assert_close(stream, residual + x)
    torch.testing.assert_close(normed, F.rms_norm(residual + x, (dim,), weight, 1e-6))
    with pytest.raises(ValueError, match="contiguous"):  # it is written in place, row by row
        ops.rms_norm(x, weight, 1e-6, torch.randn(dim, 9).t())


@needs_kernels
@pytest.mark.parametrize("width", [1536, 19])
def test_silu_mul_matches_torch_including_extremes(width: int) -> None:
    torch.manual_seed(3)
    gate_up = torch.randn(5, 2 * width) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -88.5, 88.5, 200.0])  # where exp over- or underflows
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("tokens,head_dim", [(3, 64), (70, 16), (5, 40)])
def test_rotary_in_place_matches_the_torch_rotary(tokens: int, head_dim: int) -> None:
    """q and k rotated where they lie in a qkv row (strided rows); v, beside them, is left alone."""
    torch.manual_seed(5)
    heads, kv_heads = 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 5
    before = qkv.clone()
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.randn(tokens, 1, head_dim // 2) * 100
    rotations = torch.polar(torch.ones_like(angles), angles)
    expected = apply_rotary(qk, rotations)  # the torch path returns a new tensor
    assert torch.equal(qkv, before)
    assert ops.rotary_(qk, rotations).data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])
    with pytest.raises(ValueError, match="contiguous"):  # heads apart in memory: it cannot work in place
        ops.rotary_(qk.transpose(0, 1), rotations)


@needs_kernels
def test_argmax_rows_decides_ties_nans_and_infinities_as_torch_does() -> None:
    torch.manual_seed(6)
    logits = torch.randn(7, 49157)
    logits[1, 10] = logits[1, 4000] = 50.0  # a tie: the first index wins
    logits[2, 30] = logits[2, 20] = float("nan")  # a NaN counts as the largest value
    logits[3] = float("-inf")
    logits[4, -1] = float("inf")
    logits[5, 0] = 100.0
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(logits[:, :5]), logits[:, :5].argmax(dim=-1))  # a narrow strided view


@needs_kernels
def test_store_kv_matches_index_copy() -> None:
    torch.manual_seed(4)
    cache_a, cache_b = torch.zeros(40, 2, 8), torch.zeros(40, 2, 8)
    kv = torch.randn(6, 5, 8)  # k and v as strided slices of one tensor, like the qkv projection's
    k, v = kv[:, :2], kv[:, 2:4]
    slots = torch.tensor([3, 17, 0, 39, 8, 9])
    ops.store_kv(k, v, slots, cache_a, cache_b)
    torch.testing.assert_close(cache_a, torch.zeros(40, 2, 8).index_copy_(0, slots, k), rtol=0, atol=0)
    torch.testing.assert_close(cache_b, torch.zeros(40, 2, 8).index_copy_(0, slots, v), rtol=0, atol=0)
