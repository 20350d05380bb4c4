"""Which engine replica gets a request: prefix affinity, least loaded, or round robin.

Pure bookkeeping (no Ray here), so the policies are tested alone; server/replicas.py calls it.

Prefix affinity keys a prompt by the hashes of its first `PREFIX_BLOCKS` full block-sized chunks of
token ids, each chained to the one before (the engine's prefix cache keys its blocks the same way,
so two prompts share a key exactly where they could share cached KV blocks). A table remembers
which replica last got each key; a new prompt goes to the owner of its longest known prefix unless
that replica is busier than the least loaded one by more than `BALANCE_THRESHOLD` requests, and
otherwise to the lighter of two replicas drawn at random (power of two choices).
"""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass

ROUTER_POLICIES = ("prefix-affinity", "least-loaded", "round-robin")
PREFIX_BLOCKS = 32  # chunks hashed per prompt: a prefix past 32 blocks is already long enough to route by
TABLE_SIZE = 1 << 16  # prefix keys remembered (LRU), ~100 bytes each
BALANCE_THRESHOLD = 8  # in-flight requests an affine replica may carry over the least loaded one


def prefix_hashes(prompt_ids: list[int], block_size: int, limit: int = PREFIX_BLOCKS) -> list[int]:
    """The chained hashes of the prompt's full blocks, at most `limit`; the last token is left out,
    as the engine never serves it from its cache (its forward pass yields the first logits)."""
    hashes: list[int] = []
    parent = 0
    cacheable = len(prompt_ids) - 1
    for start in range(0, min(cacheable - cacheable % block_size, limit * block_size), block_size):
        parent = hash((parent, tuple(prompt_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class RouteDecision:
    replica: int
    prefix_hit: bool  # sent to the replica that got the same prefix before


class ReplicaRouter:
    """Picks a replica per request and counts each replica's requests in flight."""

    def __init__(self, num_replicas: int, policy: str = "prefix-affinity", block_size: int = 16,
                 seed: int | None = None) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.inflight = [0] * num_replicas
        self._owners: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica that last got it
        self._cycle = itertools.cycle(range(num_replicas))
        self._random = random.Random(seed)

    def route(self, prompt_ids: list[int], exclude: tuple[int, ...] = ()) -> RouteDecision:
        """The replica for this prompt, never one in `exclude` (replicas that already failed it)."""
        candidates = [i for i in range(self.num_replicas) if i not in exclude]
        if not candidates:
            raise ValueError("every replica was excluded")
        if self.policy == "round-robin":
            return RouteDecision(next(i for i in self._cycle if i in candidates), False)
        if self.policy == "least-loaded":
            return RouteDecision(self._two_choices(candidates), False)
        hashes = prefix_hashes(prompt_ids, self.block_size)
        owner = None
        for key in hashes:  # chained: the first unknown key ends the known prefix
            if key not in self._owners:
                break
            owner = self._owners[key]
        lightest = min(self.inflight[i] for i in candidates)
        hit = owner in candidates and self.inflight[owner] - lightest <= BALANCE_THRESHOLD
        replica = owner if hit else self._two_choices(candidates)
        for key in hashes:
            self._owners[key] = replica
            self._owners.move_to_end(key)
        while len(self._owners) > TABLE_SIZE:
            self._owners.popitem(last=False)
        return RouteDecision(replica, hit)

    def _two_choices(self, candidates: list[int]) -> int:
        """Power of two choices: the less loaded of two distinct replicas drawn at random."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(candidates, 2)
        return a if self.inflight[a] <= self.inflight[b] else b
