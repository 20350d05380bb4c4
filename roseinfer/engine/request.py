"""Plain state of one request as it moves through the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from roseinfer.engine.penalties import PenaltyCounts
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.engine.structured_output import GrammarMatcher


# overlap scheduling: a token a launched step samples, its id not on the host yet (engine/core.py)
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities (of the model's raw distribution) for one generated token (a msgspec struct:
    it crosses the engine core's boundary, engine/outputs.py)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the N most likely tokens, best first


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by generated tokens: what a (re)computation feeds the model
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at (last) admission
    num_preemptions: int = 0
    # prefix-cache bookkeeping: blocks already indexed and the chain key of the last one
    num_indexed_blocks: int = 0
    last_block_key: int | None = None
    # leading block_table entries given back to the pool, outside every layer's window (block_manager.py)
    num_released_blocks: int = 0
    state_slot: int | None = None  # hybrid models: the request's slot in the state pool (engine/state_pool.py)
    # LongRoPE (Phi-3/4): the model's original context, past which a sequence's K/V are all rotated
    # with the long factors (ModelConfig.long_rope_from; None for other models), and whether
    # its cached K/V were rotated so (set when its blocks are allocated)
    long_rope_from: int | None = None
    kv_rotated_long: bool = False
    step_count: int = 0  # engine steps this request was part of
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why the engine ended it early, for the caller ("abort")
    # with prompt_logprobs: one entry per prompt token taken so far, the first None (no context)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    generator: torch.Generator | None = None
    penalty_counts: PenaltyCounts | None = None  # the sampler's, made on its first step with penalties
    grammar: GrammarMatcher | None = None  # with structured_outputs: what may come next
    # speculative decoding: verifications in a row that accepted nothing, and steps left without drafts
    spec_misses: int = 0
    spec_pause: int = 0
    draft: list[int] = field(default_factory=list)  # proposed after its last step, verified in its next
    # an embedding request: its prompt's hidden states pooled (engine/pooling.py), no token generated
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | None = None  # the pooled value so far, over the chunks computed
    admitted_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_placeholder(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == PLACEHOLDER

    def drop_placeholders(self) -> None:
        while self.has_placeholder:
            self.token_ids.pop()

    @property
    def rotates_long(self) -> bool:
        """transformers rotates a sequence longer than LongRoPE's original context with the long factors
        throughout, recomputing its cache once at the crossing (Phi3ForCausalLM.prepare_inputs_for_generation)."""
        return self.long_rope_from is not None and self.num_tokens > self.long_rope_from

    def draft_room(self, proposed: int) -> int:
        """Draft tokens a verification may take: none that would carry a short-rotated sequence past
        LongRoPE's switch, where its K/V are recomputed (the scheduler's `_recompute`)."""
        if self.long_rope_from is None or self.rotates_long:
            return proposed
        return max(0, min(proposed, self.long_rope_from - self.num_tokens))

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_prefix_hit(self) -> int:
        """Tokens the prefix cache may serve: never the last (its logits pick the next token), nor
        a position whose logits still owe a prompt logprob or whose hidden state is pooled (cached
        positions are never computed)."""
        if self.pooling_params is not None and self.pooling_params.pooling != "last":
            return 0  # the positions pooled (all of them, or the first) must be computed
        if len(self.prompt_logprobs) < self.num_prompt_tokens and self.sampling_params.prompt_logprobs is not None:
            return len(self.prompt_logprobs) - 1
        return self.num_tokens - 1

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """Positions among the next num_new_tokens to compute whose logits give a prompt logprob
        not taken yet: the logits at position p give token p + 1's. After a preemption, the
        positions already taken are not taken again."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        start = self.num_computed_tokens
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num_new_tokens, self.num_prompt_tokens - 1))

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs its K/V computed."""
        return self.num_tokens - self.num_computed_tokens > 1
