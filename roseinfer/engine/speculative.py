"""Speculative decoding: propose (n-gram prompt lookup here, a draft model in draft_model.py), verify, adapt.

After each step the engine core asks `propose` for the drafts of every running decode at once; a
draft's tokens ride in the request's next step as a chunk of 1 + K query tokens, and the runner
samples all K + 1 rows. `accept_draft` keeps the draft's longest prefix the target's samples agree
with, plus the target's own next token, so a greedy request emits exactly the tokens it would have
one by one, and a sampled one draws from exactly the target's distribution (see accept_draft).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from roseinfer.config import SpeculativeConfig
from roseinfer.engine.request import Request

MAX_BACKOFF_STEPS = 64  # the longest pause of a request whose proposals keep failing


@dataclass
class SpecStats:
    """Engine-wide counters since start (vLLM's metric names)."""

    num_drafts: int = 0  # verification steps, one per speculating request per step
    num_draft_tokens: int = 0  # proposed
    num_accepted_tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        # accepted tokens plus the target's own token, per verification step
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens, "spec_mean_accepted_length": mean}


def can_speculate(req: Request) -> bool:
    """Requests whose next tokens' distributions depend on nothing but each row's logits. The others
    decode one token a step: penalties and a pending min_tokens stop mask depend on the tokens
    emitted before each row (row i would need the draft's first i tokens in its penalty context),
    a grammar's mask on its matcher's state, and logprobs are kept for one token a step."""
    p = req.sampling_params
    return (p.logprobs is None and req.grammar is None and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty and req.num_output_tokens >= p.min_tokens)


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, n from
    n_max down to n_min; of the occurrences of the longest n that matches, the most recent with k
    tokens after it is preferred, since a match just behind the end has only a short continuation."""
    arr = np.asarray(tokens)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # window i covers i .. i + n - 1 and has at least one token after it
        hits = np.flatnonzero((sliding_window_view(arr[:length - 1], n) == arr[length - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = int((full if full.size else hits)[-1]) + n
            return tokens[start:start + k]
    return []


def accept_draft(draft: list[int], targets: list[int]) -> list[int]:
    """targets[i] is the target's token after the draft's first i tokens: keep the draft while it
    agrees, then the target's correction (or its bonus token when all K agreed).

    For sampled rows this is rejection sampling (Leviathan et al. 2023) with a point-mass draft
    q = 1[d]: t_i ~ p_i gives P(accept d_i) = p_i(d_i) = min(1, p_i(d_i) / q(d_i)), and given
    t_i != d_i, t_i ~ p_i without d_i renormalised = norm(max(p_i - q, 0)), the residual; after K
    acceptances t_K ~ p_K is the bonus token. Proposers here are deterministic, so q is one."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return targets[:accepted + 1]


class Proposer:
    """Drafts for running decodes, with the back-off and counters every method shares; a subclass
    says how to guess (`draft`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Each request's draft for its next step (maybe empty), never longer than its max_tokens or
        the context allow (the target adds one token of its own); the scheduler cuts it to the
        step's token budget."""
        lengths = [self._draft_length(req) for req in requests]
        asked = [(req, k) for req, k in zip(requests, lengths) if k > 0]
        drafts = iter(self.draft(asked) if asked else [])
        return [next(drafts) if k > 0 else [] for k in lengths]

    def _draft_length(self, req: Request) -> int:
        if req.spec_pause > 0:
            req.spec_pause -= 1
            return 0
        if not can_speculate(req):
            return 0
        return max(0, min(self.config.num_speculative_tokens, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def draft(self, asked: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k tokens to follow each request's token_ids, for all of them at once."""
        raise NotImplementedError

    def record(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """Count one verification; a request whose proposals all fail pauses for 1, 2, 4 ... steps,
        so where proposing does not help it costs a bounded share of steps."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        if num_accepted:
            req.spec_misses = 0
        else:
            req.spec_pause = min(1 << req.spec_misses, MAX_BACKOFF_STEPS)
            req.spec_misses += 1


class NgramProposer(Proposer):
    def draft(self, asked: list[tuple[Request, int]]) -> list[list[int]]:
        c = self.config
        return [ngram_lookup(req.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k) for req, k in asked]
