"""KV blocks: reference counts, a hash-chained prefix cache and LRU eviction.

A block is *free* (no data worth keeping), *cached* (unreferenced but holding a full block whose
key is in the hash index, evictable) or *used* (ref_count > 0). A full block's key chains the
key of the block before it with its own tokens, so equal keys mean equal whole prefixes; the
stored tokens are compared too, so a hash collision can never serve wrong K/V.

Where every layer of the model slides (`sliding_window`: the widest layer's window), a request's
blocks that fall wholly before every window are given back as it grows (`release_outside_window`):
the request's table keeps its length, those leading entries reading block 0, which no attention
reads (layers/attention.py). Indexed ones stay in the prefix cache, evictable.

A hybrid model's requests also hold a state-pool slot (engine/state_pool.py), taken with their first
blocks and given back with all of them, so the scheduler admits by both pools through this one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from roseinfer.engine.request import Request
from roseinfer.engine.state_pool import StatePool


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # hash-chain key when the block is full and indexed
    parent_key: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from cache
    block_queries: int = 0
    block_hits: int = 0


LONG_ROPE_ROOT = 1


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    sliding_window: int | None = None  # ModelConfig.kv_window: None where some layer sees the whole context
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    state_pool: StatePool | None = None  # hybrid models' linear-attention state slots

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # A stack: the most recently freed block is handed out first, while its rows may still be in cache.
        self.free_ids: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recent first
        self.index: dict[int, int] = {}  # key -> block id

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def stats_dict(self) -> dict[str, int]:
        slots = {} if self.state_pool is None else {"state_slots": self.state_pool.num_slots,
                                                     "free_state_slots": self.state_pool.num_free_slots}
        return {
            **slots,
            "total_blocks": self.num_blocks,
            "free_blocks": self.num_free_blocks,
            "used_blocks": self.num_used_blocks,
            "cached_blocks": len(self.index),
            "evictable_blocks": len(self.evictable),
            "prefix_cache_queries": self.stats.queries,
            "prefix_cache_hits": self.stats.hits,
            "prefix_cache_block_queries": self.stats.block_queries,
            "prefix_cache_block_hits": self.stats.block_hits,
        }

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- admission: reuse the longest cached prefix ---------------------------------------
    def allocate_cached_prefix(self, req: Request) -> int:
        """Give a request with no blocks every cached block of its longest cached prefix (where every
        layer slides, only those inside the window: the others are found, to prove the prefix, but
        not taken).

        The last token is never served from cache (its forward pass produces the logits), nor are
        positions that still owe prompt logprobs (Request.max_prefix_hit).
        Returns the number of tokens covered (a multiple of block_size).
        """
        assert not req.block_table, "request already holds blocks"
        req.kv_rotated_long = req.rotates_long
        if not self.enable_prefix_caching:
            return 0
        # K/V rotated with LongRoPE's long factors chain from their own root: never shared with short ones
        parent: int | None = LONG_ROPE_ROOT if req.kv_rotated_long else None
        found: list[int] = []
        for i in range(req.max_prefix_hit // self.block_size):
            tokens = tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._lookup(parent, tokens)
            if block_id is None:
                break
            found.append(block_id)
            parent = self.blocks[block_id].key
        released = self._blocks_outside_window(len(found) * self.block_size)
        for block_id in found[released:]:
            self._take(block_id)
        req.block_table = [0] * released + found[released:]
        req.num_indexed_blocks, req.last_block_key, req.num_released_blocks = len(found), parent, released
        return len(found) * self.block_size

    def record_lookup(self, req: Request, hit_tokens: int) -> None:
        """Count one admitted lookup (failed admissions that are undone do not count)."""
        self.stats.queries += req.num_tokens
        self.stats.hits += hit_tokens
        self.stats.block_queries += (req.num_tokens - 1) // self.block_size
        self.stats.block_hits += hit_tokens // self.block_size

    def _lookup(self, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        block_id = self.index.get(_key(parent, tokens))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block_id if block.parent_key == parent and block.tokens == tokens else None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1

    # ---- growth --------------------------------------------------------------------------
    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make the block table cover num_computed + num_new tokens; False (and no change) if it cannot."""
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if needed > self.num_free_blocks:
            return False
        if self.state_pool is not None and not self.state_pool.allocate(req):
            return False
        for _ in range(needed):
            req.block_table.append(self._allocate_block())
        return True

    def shrink(self, req: Request) -> None:
        """Give back the blocks past the request's computed tokens (a draft's rejected positions);
        they were never indexed, since only computed full blocks are."""
        keep = self.blocks_needed(req.num_computed_tokens)
        for block_id in req.block_table[keep:]:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.key is None, f"block {block_id} is shared or indexed"
            block.ref_count = 0
            self.free_ids.append(block_id)
        del req.block_table[keep:]

    def _allocate_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently used
            self._unindex(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def cache_full_blocks(self, req: Request) -> None:
        """Index the request's newly full, computed blocks so later requests can share them.

        Starts where the last call stopped, so a step costs O(new blocks), not O(context).
        """
        if not self.enable_prefix_caching:
            return
        parent = req.last_block_key
        for i in range(req.num_indexed_blocks, req.num_computed_tokens // self.block_size):
            block = self.blocks[req.block_table[i]]
            if block.key is None:
                tokens = tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
                key = _key(parent, tokens)
                if key not in self.index:
                    block.key, block.parent_key, block.tokens = key, parent, tokens
                    self.index[key] = block.block_id
                # else: another block already holds this prefix; this copy stays private and the
                # chain continues from the indexed key, so later blocks are still findable.
                parent = key
            else:
                parent = block.key
            req.num_indexed_blocks, req.last_block_key = i + 1, parent

    # ---- release -------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Drop the request's references. Last blocks first, so a prefix's tail is evicted before its head."""
        for block_id in reversed(req.block_table[req.num_released_blocks:]):
            self._drop(block_id)
        req.block_table = []
        req.num_indexed_blocks, req.last_block_key, req.num_released_blocks = 0, None, 0
        if self.state_pool is not None:
            self.state_pool.free(req)

    def release_outside_window(self, req: Request) -> None:
        """Give back the request's blocks that no later query can attend to: its next position p is
        at least num_computed_tokens, and p sees keys after p - sliding_window only. Called once a
        step's blocks are indexed, so the released ones stay findable in the prefix cache."""
        dead = self._blocks_outside_window(req.num_computed_tokens)
        for i in range(req.num_released_blocks, dead):
            self._drop(req.block_table[i])
            req.block_table[i] = 0
        req.num_released_blocks = max(req.num_released_blocks, dead)

    def _blocks_outside_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position num_computed_tokens on can attend to."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.key is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def _unindex(self, block: Block) -> None:
        if block.key is not None and self.index.get(block.key) == block.block_id:
            del self.index[block.key]
        block.key, block.parent_key, block.tokens = None, None, ()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody uses."""
        while self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._unindex(self.blocks[block_id])
            self.free_ids.append(block_id)


def _key(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))
