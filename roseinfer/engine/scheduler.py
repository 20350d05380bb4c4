"""Continuous batching: which requests compute how many tokens in the next forward pass.

One step = one forward over a mixed batch under a unified token budget: running requests come
first (decodes, then the next chunk of prompts already admitted), then new requests are admitted
with what is left. When blocks run out, the most recently admitted request is preempted
(blocks freed, requeued at the front, recomputed later -- mostly from the prefix cache).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.outputs import EngineCoreOutput, request_times
from roseinfer.engine.pooling import add_part, embedding
from roseinfer.engine.request import PLACEHOLDER, Request, RequestStatus, TokenLogprobs
from roseinfer.engine.speculative import NgramProposer, Proposer

UNLIMITED = 1 << 62


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens whose K/V this step computes, the draft's included
    draft: list[int] = field(default_factory=list)  # proposed tokens fed after the last known one
    placeholder: int | None = None  # advanced: where its sampled token waits in token_ids

    @property
    def reaches_end(self) -> bool:
        """The chunk reaches the end of the known tokens."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def samples(self) -> bool:
        """Its last logits pick the next token: it reaches the end, and is no embedding request."""
        return self.reaches_end and self.request.pooling_params is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    advanced: bool = False  # its tokens counted computed at launch (Scheduler.advance)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int], proposer: Proposer | None = None) -> None:
        """proposer: the speculative proposer the engine built (a draft model's); without one, an
        n-gram speculative_config gets its NgramProposer here."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: deque[str] = deque()  # the finished-event queue
        self.max_running = min(config.max_num_seqs, config.max_active_requests or UNLIMITED)
        self._admitting_steps = 0
        self._decode_turn = True
        self.num_preemptions = 0  # since the engine started (a server exports it)
        spec = config.speculative
        if proposer is None and spec is not None and spec.method != "ngram":
            raise ValueError(f"speculative method {spec.method} needs its proposer built by the engine")
        self.proposer = proposer or (NgramProposer(spec, max_model_len) if spec is not None else None)
        # only that many decodes are given drafts (EngineCore._propose); the cap makes it a bound that a
        # hybrid model's scratch slots for drafts are sized by (worker.py draft_state_slots)
        self.max_drafts_per_step = spec.disable_by_batch_size if spec is not None else 0

    # ---- lifecycle -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        req.drop_placeholders()
        self._stop(req, "abort")

    def _stop(self, req: Request, reason: str) -> None:
        """Out of its queue (waiting too: preempted while its last step was in flight) and finished."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self._finish(req, reason)

    def pop_finished_ids(self) -> list[str]:
        ids = list(self.finished_ids)
        self.finished_ids.clear()
        return ids

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.config.max_num_batched_tokens, self.config.prefill_max_tokens or UNLIMITED]
        phase = self._phase()
        self._schedule_running(out, budget, phase)
        if phase != "decode" and not out.preempted_ids:
            self._admit_waiting(out, budget)
        return out

    def _phase(self) -> str | None:
        """With decode_first, steps alternate between decode-only and prefill-only batches
        whenever both kinds of work exist; otherwise every step mixes them."""
        if not self.config.decode_first:
            return None
        has_decode = any(not r.in_prefill for r in self.running)
        has_prefill = bool(self.waiting) or any(r.in_prefill for r in self.running)
        if not (has_decode and has_prefill):
            return None
        self._decode_turn = not self._decode_turn
        return "prefill" if self._decode_turn else "decode"

    def _schedule_running(self, out: SchedulerOutput, budget: list[int], phase: str | None) -> None:
        i = 0
        drafts = 0
        while i < len(self.running) and budget[0] > 0 and len(out.scheduled) < self.config.max_num_seqs:
            req = self.running[i]
            i += 1
            if req.rotates_long != req.kv_rotated_long:
                self._recompute(req)
                i -= 1
                continue
            if req.token_ids[-1] == PLACEHOLDER and self._reaches_length(req):
                continue  # its pending token ends it (length): a step more would be thrown away
            prefill = req.in_prefill
            if (phase == "decode" and prefill) or (phase == "prefill" and not prefill):
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            # the draft proposed after its last step, cut to what the budget and the request leave
            draft = ([] if prefill or req.pooling_params is not None or drafts >= self.max_drafts_per_step
                     else req.draft[:budget[0] - 1])
            draft = draft[:req.draft_room(len(draft))]
            if draft and not self.block_manager.can_append(req, 1 + len(draft)):
                draft = []  # a draft never preempts anyone
            drafts += bool(draft)
            n = min(remaining, budget[0], budget[1]) if prefill else 1 + len(draft)
            if n <= 0 or (n < remaining and not self.config.enable_chunked_prefill):
                continue
            while not self.block_manager.can_append(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    return
            self.block_manager.append_slots(req, n)
            out.scheduled.append(ScheduledRequest(req, n, draft))
            req.draft = []
            budget[0] -= n
            if prefill:
                budget[1] -= n

    def _admission_order(self) -> list[Request]:
        if self.config.prefill_admission_policy == "fifo":
            return list(self.waiting)
        self._admitting_steps += 1
        window = [self.waiting[i] for i in range(min(self.config.pack_lookahead, len(self.waiting)))]
        if self._admitting_steps % self.config.pack_fifo_every == 0:
            return window  # starvation guard: the head goes first now and then
        return sorted(window, key=lambda r: r.num_tokens)

    def _admit_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        if not self.waiting:
            return
        pack = self.config.prefill_admission_policy == "pack"
        max_new = self.config.prefill_max_batch_size or UNLIMITED
        admitted = 0
        for req in self._admission_order():
            if (len(self.running) >= self.max_running or admitted >= max_new or budget[0] <= 0
                    or budget[1] <= 0 or len(out.scheduled) >= self.config.max_num_seqs):
                break
            hit = self.block_manager.allocate_cached_prefix(req)
            req.num_computed_tokens = hit
            remaining = req.num_tokens - hit
            n = min(remaining, budget[0], budget[1])
            # pack admits whole prompts only (the head may still be chunked when nothing else fits)
            too_big = n < remaining and (not self.config.enable_chunked_prefill or (pack and admitted > 0))
            if too_big or not self.block_manager.append_slots(req, n):
                self.block_manager.free(req)
                req.num_computed_tokens = 0
                if pack and too_big:
                    continue
                break
            self.block_manager.record_lookup(req, hit)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_cached_tokens = hit
            if req.admitted_time is None:
                req.admitted_time = time.perf_counter()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget[0] -= n
            budget[1] -= n
            admitted += 1

    def _preempt(self, req: Request) -> None:
        self._recompute(req)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def _recompute(self, req: Request) -> None:
        """Back to the front of the queue, its cache given up: admitted again, its K/V are computed again
        (mostly from the prefix cache). Without preemption, where LongRoPE switches factors."""
        self.block_manager.free(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.draft = []
        req.pooled = None
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---- results ---------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Overlap scheduling: a launched step's tokens count as computed, and each token it samples
        waits as a PLACEHOLDER, so that the next step is scheduled before the ids reach the host;
        update() puts them in. A request that finished meanwhile is left alone."""
        out.advanced = True
        for item in out.scheduled:
            req = item.request
            if req.is_finished or req.pooling_params is not None:
                continue  # an embedding request's batch is read at once, and _pool counts its tokens
            samples = item.samples
            req.num_computed_tokens += item.num_tokens
            if samples:
                item.placeholder = req.num_tokens
                req.token_ids.append(PLACEHOLDER)

    def update(self, out: SchedulerOutput, sampled: list[list[int]], logprobs: list[TokenLogprobs | None],
               prompt_logprobs: list[list[TokenLogprobs]] | None = None,
               pooled: list[torch.Tensor | None] | None = None) -> list[EngineCoreOutput]:
        """Apply one step's tokens (none for rows that only computed a prompt chunk; a verified draft
        may give several), the prompt logprobs it took and embedding requests' pooled parts."""
        outputs: list[EngineCoreOutput] = []
        now = time.perf_counter()
        for i, (item, tokens, logprob) in enumerate(zip(out.scheduled, sampled, logprobs)):
            req = item.request
            if out.advanced:
                if req.is_finished:
                    continue  # ended (stop, length or abort) by a step before: this step's token is not its
                if item.placeholder is not None:
                    del req.token_ids[item.placeholder:]
            if req.pooling_params is not None:
                self._pool(item, pooled[i] if pooled else None, now, outputs)
                continue
            if prompt_logprobs:
                req.prompt_logprobs += prompt_logprobs[i]
            req.step_count += 1
            if item.draft:
                self.proposer.record(req, len(item.draft), len(tokens) - 1)
            emitted: list[int] = []
            reason: str | None = None
            for token in tokens:
                req.token_ids.append(token)
                emitted.append(token)
                if req.grammar is not None and not req.grammar.accept(token):
                    # llguidance gave up on the grammar (a limit on its work per token): never emit past it
                    reason = "abort"
                    req.error = f"the output constraint failed while generating: {req.grammar.error}"
                else:
                    reason = self._stop_reason(req, token)
                if reason is not None:
                    break  # nothing past a stop, even inside an accepted draft
            if not out.advanced:
                # every input position whose token was kept has valid K/V; the last emitted one has none yet
                req.num_computed_tokens += item.num_tokens - len(item.draft) + max(len(emitted) - 1, 0)
            if item.draft:
                self.block_manager.shrink(req)
            self.block_manager.cache_full_blocks(req)
            self.block_manager.release_outside_window(req)
            if not emitted:
                continue
            req.token_times += [now] * len(emitted)
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
            if reason is not None:
                self._stop(req, reason)
            params = req.sampling_params
            wants_prompt = first and params.prompt_logprobs is not None
            last = emitted[-1]
            # vLLM's stop_reason: the stop token id, unless the token stopped the request as its EOS
            stop_token = last if reason == "stop" and last in params.stop_token_ids and not (
                last in self.eos_token_ids and not params.ignore_eos) else None
            outputs.append(EngineCoreOutput(
                req.request_id, emitted, reason, [logprob] if logprob is not None else [],
                list(req.prompt_logprobs) if wants_prompt else None, req.error if reason is not None else None,
                req.num_prompt_tokens, req.num_cached_tokens, request_times(req) if first or reason else None,
                stop_token))
        return outputs

    def _pool(self, item: ScheduledRequest, part: torch.Tensor | None, now: float,
              outputs: list[EngineCoreOutput]) -> None:
        """An embedding request's step: its pooled value grows; once its prompt is done, it finishes
        with its vector (its blocks freed: no KV is kept for it)."""
        req = item.request
        done = item.reaches_end  # read before the computed tokens move on
        req.step_count += 1
        add_part(req, part)
        req.num_computed_tokens += item.num_tokens
        self.block_manager.cache_full_blocks(req)
        if not done:
            return
        req.first_token_time = now
        self.running.remove(req)
        self._finish(req, "stop")
        outputs.append(EngineCoreOutput(req.request_id, [], "stop", num_prompt_tokens=req.num_prompt_tokens,
                                        num_cached_tokens=req.num_cached_tokens, times=request_times(req),
                                        embedding=embedding(req)))

    def _stop_reason(self, req: Request, token: int) -> str | None:
        params = req.sampling_params
        if req.grammar is not None and req.grammar.is_complete:
            return "stop"  # the constrained output is whole: only its end could follow
        # The sampler masks EOS and stop ids for the first min_tokens tokens; this guards the same rule.
        if req.num_output_tokens > params.min_tokens:
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                return "stop"
        return "length" if self._reaches_length(req) else None

    def _reaches_length(self, req: Request) -> bool:
        return req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.max_model_len

    def _finish(self, req: Request, reason: str) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        self.finished_ids.append(req.request_id)
