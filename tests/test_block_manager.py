"""Block manager: prefix sharing, LRU eviction, and a property test of its invariants."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.sampling_params import SamplingParams

BS = 16


def _request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _compute(bm: BlockManager, req: Request) -> None:
    """What a scheduler does for a whole prompt: allocate, 'compute', index the full blocks."""
    req.num_computed_tokens = bm.allocate_cached_prefix(req)
    assert bm.append_slots(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_shared_64_token_prefix_reuses_exactly_4_blocks():
    bm = BlockManager(num_blocks=32, block_size=BS)
    prefix = list(range(100, 164))
    first = _request(prefix + [1, 2, 3], "a")
    _compute(bm, first)
    second = _request(prefix + [7, 8, 9, 10], "b")
    hit = bm.allocate_cached_prefix(second)
    assert hit == 64 and second.block_table == first.block_table[:4]
    assert all(bm.blocks[b].ref_count == 2 for b in second.block_table)


def test_partial_last_block_and_last_token_are_never_shared():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = _request(list(range(32)), "a")  # exactly two full blocks
    _compute(bm, first)
    repeat = _request(list(range(32)), "b")
    # the last token must be computed for its logits, so only the first block is reused
    assert bm.allocate_cached_prefix(repeat) == 16


def test_eviction_picks_least_recently_used_unreferenced_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = _request(list(range(0, 17)), "old")
    new = _request(list(range(50, 67)), "new")
    _compute(bm, old)
    _compute(bm, new)
    old_block_id, new_block_id = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    # both full blocks are cached and evictable; 'old' was freed first, so it goes first
    taker = _request(list(range(200, 233)), "taker")  # needs 3 blocks: 2 free + 1 evicted
    assert bm.append_slots(taker, taker.num_tokens)
    assert old_block_id in taker.block_table and new_block_id not in taker.block_table
    assert bm.allocate_cached_prefix(_request(list(range(50, 67)), "again")) == 16
    assert bm.allocate_cached_prefix(_request(list(range(0, 17)), "gone")) == 0


def _check_invariants(bm: BlockManager, live: list[Request]) -> None:
    refs = [0] * bm.num_blocks
    for req in live:
        for b in req.block_table:
            refs[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == refs
    free = set(bm.free_ids)
    evictable = set(bm.evictable)
    assert len(free) == len(bm.free_ids) and not free & evictable
    for blk in bm.blocks:
        if blk.ref_count:
            assert blk.block_id not in free and blk.block_id not in evictable
        else:
            assert (blk.block_id in evictable) == (blk.key is not None)
            assert (blk.block_id in free) == (blk.key is None)
    for key, block_id in bm.index.items():
        assert bm.blocks[block_id].key == key
    assert bm.num_free_blocks + sum(1 for r in refs if r) == bm.num_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt", "reset"]),
                          st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=40))
def test_random_operation_sequences_keep_the_books_consistent(ops):
    bm = BlockManager(num_blocks=12, block_size=4)
    live: list[Request] = []
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23], []]
    for n, (op, which, length) in enumerate(ops):
        if op == "add":
            req = _request(prefixes[which] + [100 + n] * length, f"r{n}")
            req.num_computed_tokens = bm.allocate_cached_prefix(req)
            if bm.append_slots(req, min(req.num_tokens - req.num_computed_tokens, 8)):
                req.num_computed_tokens += min(req.num_tokens - req.num_computed_tokens, 8)
                bm.cache_full_blocks(req)
                live.append(req)
            else:
                bm.free(req)
        elif op == "grow" and live:
            req = live[which % len(live)]
            req.token_ids.extend([7] * (length % 6))
            step = req.num_tokens - req.num_computed_tokens
            if step and bm.append_slots(req, step):
                req.num_computed_tokens += step
                bm.cache_full_blocks(req)
        elif op in ("free", "preempt") and live:
            req = live.pop(which % len(live))
            bm.free(req)
            req.num_computed_tokens = 0
        elif op == "reset":
            bm.reset_prefix_cache()
        _check_invariants(bm, live)
    for req in live:
        bm.free(req)
    _check_invariants(bm, [])
    assert bm.num_used_blocks == 0


def test_freed_blocks_are_reused_first():
    """A stack, not a queue: a freed block comes back before never-touched ones, so the pool's
    touched (resident) part stays as small as the peak load."""
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    first = _request(list(range(40)), "a")
    _compute(bm, first)
    assert first.block_table == [0, 1, 2]
    used = set(first.block_table)
    bm.free(first)
    second = _request(list(range(500, 540)), "b")
    _compute(bm, second)
    assert set(second.block_table) == used
