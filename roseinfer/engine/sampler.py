"""Batched sampling: grammar masks, penalties, logit bias, min_tokens, temperature, top-k / top-p /
min-p, seeds.

Greedy batches without penalties take one argmax. Otherwise every step works on the whole
[N, V] block on the logits' device: what it needs from the host (token ids, settings) is gathered
first and copied in one transfer per dtype, and what comes back (tokens, logprobs) in one.
Sampled rows use the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly from
p; a row that filters races only among its candidates (sampling_filters.py), which hold every token
it keeps. A request with a seed draws a whole row of q from its own generator each step (as it
always has, exponential_), so its tokens do not depend on what else is in the batch. The rows
whose candidates cannot decide their filters are sampled again over their whole sorted row after
that read, with a second one.
"""
from __future__ import annotations

import array
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from roseinfer.engine.host_buffer import HostBuffer, Tensors, upload
from roseinfer.engine.penalties import PenaltyCounts
from roseinfer.engine.request import Request, TokenLogprobs
from roseinfer.engine.sampling_filters import FilterSettings, candidate_filter, sort_filter
from roseinfer.engine.structured_output import GrammarMasks
from roseinfer.sampling_params import SamplingParams

NEG_INF = float("-inf")
TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max
PENALIZED_LIMIT = 1e30  # over SAMPLING_EPS (1e-5) still 1e35, finite in fp32
Argmax = Callable[[torch.Tensor], torch.Tensor]
PROCESSED_BY = ("seen", "output", "bias_ids", "banned")  # the id sections _process applies


@dataclass
class _Retry:
    """What sampling a step's filtered rows over their whole sorted rows needs, for those whose
    candidates did not decide (Candidates.exact)."""

    exact: torch.Tensor  # [F] bool, one per filtered row
    rows: list[int]  # each filtered row's row in the batch
    logits: torch.Tensor  # [F, V]
    settings: FilterSettings
    generators: list[torch.Generator | None]
    drawn: dict[int, torch.Tensor]  # a seeded filtered row's draws this step, over the vocabulary


@dataclass
class SampledRows:
    """One launch's picks: `tokens` [N] on the device, and what read() copies to the host at once
    (`head`), or its result where launch had to read already."""

    tokens: torch.Tensor
    head: torch.Tensor
    params: list[SamplingParams]
    result: tuple[list[int], list[TokenLogprobs | None]] | None = None


def samples_on_device(req: Request) -> bool:
    """Whether a request's next token can be picked before its last one reaches the host (overlap
    scheduling): not with a grammar (its mask follows the accepted tokens), penalties (they count the
    token ids), filters (undecided candidates are read back and sampled again) or prompt logprobs
    (read from the step's hidden states after the next step has run) or an embedding (likewise)."""
    p = req.sampling_params
    filters = not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)
    return (req.grammar is None and not p.needs_penalties and not filters and p.prompt_logprobs is None
            and req.pooling_params is None)


class Sampler:
    def __init__(self, eos_token_ids: set[int], device: torch.device, seed: int, argmax: Argmax | None = None) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        # the greedy fast path's row argmax; on CPU the caller passes a C kernel, torch's being slow there
        self.argmax = argmax or _torch_argmax
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammar_masks: GrammarMasks | None = None  # made on the first constrained row

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] float32, one row per request; returns token ids and optional logprobs."""
        return self.read(self.launch(logits, requests))

    def launch(self, logits: torch.Tensor, requests: list[Request]) -> SampledRows:
        """The picks, left on the device where nothing needs the host (read() takes them); rows whose
        filters' candidates did not decide are read and sampled again here."""
        params = [r.sampling_params for r in requests]
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            # before everything else, logprobs included: what a constrained row reports is its grammar's choice
            self.grammar_masks = self.grammar_masks or GrammarMasks()
            logits = self.grammar_masks.apply(logits, constrained, [requests[i].grammar for i in constrained])
        ints, floats = self._inputs(requests, logits.shape[1], logits.device)
        if all(p.greedy for p in params) and not any(name in ints for name in PROCESSED_BY):
            tokens = self.argmax(logits)
            return SampledRows(tokens, self._head(logits, tokens, params, ints, None), params)
        tokens, retry = self._sample(self._process(logits, ints, floats), requests, ints, floats)
        head = self._head(logits, tokens, params, ints, retry)
        if retry is None:
            return SampledRows(tokens, head, params)
        token_list, logprobs, undecided = self._unpack(head.tolist(), params, retry)
        if undecided:
            tokens = self._resample(tokens, retry, undecided)
            token_list, logprobs, _ = self._unpack(self._head(logits, tokens, params, ints, None).tolist(), params, None)
        return SampledRows(tokens, head, params, (token_list, logprobs))

    def read(self, rows: SampledRows) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Token ids and logprobs from one device-to-host copy."""
        if rows.result is not None:
            return rows.result
        token_list, logprobs, _ = self._unpack(rows.head.tolist(), rows.params, None)
        return token_list, logprobs

    def _head(self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], ints: Tensors,
              retry: _Retry | None) -> torch.Tensor:
        """Tokens, which filtered rows decided (with a retry), then the packed logprobs, in one tensor."""
        head = tokens if retry is None else torch.cat([tokens, retry.exact.to(tokens.dtype)])
        order = _logprob_rows(params)
        if order:
            rows = ints.get("logprob_rows")
            raw = logits if rows is None else logits[rows]
            chosen = tokens if rows is None else tokens[rows]
            packed = _pack_logprobs(torch.log_softmax(raw, dim=-1), chosen, [params[i].logprobs for i in order])
            head = torch.cat([head.to(packed.dtype), packed])
        return head

    def _unpack(self, values: list, params: list[SamplingParams],
                retry: _Retry | None) -> tuple[list[int], list[TokenLogprobs | None], list[int]]:
        """Tokens, logprobs, and the filtered rows (as _Retry numbers them) whose candidates did not
        decide, from _head's values."""
        n = len(params)
        token_list = [int(v) for v in values[:n]]
        end = n if retry is None else n + retry.exact.numel()
        undecided = [j for j, flag in enumerate(values[n:end]) if not flag]
        logprobs: list[TokenLogprobs | None] = [None] * n
        order = _logprob_rows(params)
        if order:
            entries = _unpack_logprobs(values[end:], [token_list[i] for i in order], [params[i].logprobs for i in order])
            for i, entry in zip(order, entries):
                logprobs[i] = entry
        return token_list, logprobs, undecided

    def rewind(self, generator: torch.Generator, state: torch.Tensor, num_kept: int, vocab: int) -> None:
        """Set a seeded request's generator to `state` advanced by num_kept rows of draws, as
        _draws draws them: after a verification it has drawn one row per token emitted, as one token
        a step would have, so its output does not depend on how many draft rows were drawn and rejected."""
        generator.set_state(state)
        row = torch.empty(vocab, dtype=torch.float32, device=self.device)
        for _ in range(num_kept):
            row.exponential_(generator=generator)

    def _masks_stops(self, req: Request) -> bool:
        return req.num_output_tokens < req.sampling_params.min_tokens

    def _inputs(self, requests: list[Request], vocab: int, device: torch.device) -> tuple[Tensors, Tensors]:
        """The step's host data as device tensors: id blocks [N, L] padded with `vocab` (the scratch
        column of _process), per-row settings, and the row indices that _sample and logprobs use.
        Sections a step does not need are left out, so an empty result means nothing to process."""
        params = [r.sampling_params for r in requests]
        ints, floats = HostBuffer("q"), HostBuffer("f")
        counts = [_counts(r) if r.sampling_params.needs_penalties else None for r in requests]
        if any(p.repetition_penalty != 1.0 for p in params):
            ints.add_rows("seen", [c.seen if c is not None and p.repetition_penalty != 1.0 else []
                                   for c, p in zip(counts, params)], vocab)
            # fp32 rounds 5e-324 to 0 (a masked -inf times 0 is NaN) and 1e300 to inf: kept in its range
            floats.add("repetition", [min(max(p.repetition_penalty, TINY), FLOAT32_MAX) for p in params])
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            counted = [c if c is not None and (p.frequency_penalty or p.presence_penalty) else None
                       for c, p in zip(counts, params)]
            ints.add_rows("output", [c.output_ids if c else [] for c in counted], vocab)
            floats.add_rows("counts", [c.output_counts if c else [] for c in counted], 0.0)
            floats.add("frequency", [p.frequency_penalty for p in params])
            floats.add("presence", [p.presence_penalty for p in params])
        if any(p.logit_bias for p in params):
            ints.add_rows("bias_ids", [list(p.logit_bias) for p in params], vocab)
            floats.add_rows("bias", [list(p.logit_bias.values()) for p in params], 0.0)
        banned = [self._banned(r) for r in requests]
        if any(banned):
            ints.add_rows("banned", banned, vocab)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if 0 < len(sampled) < len(params):
            ints.add("sampled_rows", sampled)
        if sampled:
            _add_filter_settings(ints, floats, [params[i] for i in sampled], vocab)
        order = _logprob_rows(params)
        if order and order != list(range(len(params))):
            ints.add("logprob_rows", order)
        return ints.upload(torch.long, device), floats.upload(torch.float32, device)

    def _banned(self, req: Request) -> list[int]:
        if not self._masks_stops(req):
            return []
        p = req.sampling_params
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)

    def _process(self, logits: torch.Tensor, ints: Tensors, floats: Tensors) -> torch.Tensor:
        """Penalties, logit bias and the stop mask over the whole block, each by its definition
        (in this order), as gathers and scatters at the rows' ids. The input is left as it is: the
        result is a new [N, V] tensor, or logits itself when no row needs any of them."""
        if not any(name in ints for name in PROCESSED_BY):
            return logits
        n, vocab = logits.shape
        # one column past the vocabulary where padded ids land, so no scatter needs a mask
        work = logits.new_empty(n, vocab + 1)
        work[:, :vocab] = logits
        work[:, vocab] = 0.0
        if "seen" in ints:
            # HF / vLLM definition over prompt and output: positive logits divided, negative multiplied;
            # what a tiny penalty divides up saturates, so the logits stay finite over any temperature
            seen, penalty = ints["seen"], floats["repetition"].unsqueeze(1)
            values = work.gather(1, seen)
            work.scatter_(1, seen, torch.where(values > 0, (values / penalty).clamp(max=PENALIZED_LIMIT),
                                               values * penalty))
        if "output" in ints:
            # OpenAI definition over generated tokens: logit -= f * count + p * (count > 0)
            out, counts = ints["output"], floats["counts"]
            delta = floats["frequency"].unsqueeze(1) * counts + \
                floats["presence"].unsqueeze(1) * (counts > 0).to(work.dtype)
            work.scatter_(1, out, work.gather(1, out) - delta)
        if "bias_ids" in ints:
            work.scatter_(1, ints["bias_ids"], work.gather(1, ints["bias_ids"]) + floats["bias"])
        if "banned" in ints:
            work.scatter_(1, ints["banned"], NEG_INF)
        return work[:, :vocab]

    def _sample(self, logits: torch.Tensor, requests: list[Request], ints: Tensors,
                floats: Tensors) -> tuple[torch.Tensor, _Retry | None]:
        """Greedy rows take the argmax; sampled rows that filter race among their candidates, the
        others over the vocabulary."""
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not sampled:
            return logits.argmax(dim=-1), None
        rows = ints.get("sampled_rows")
        vocab = logits.shape[1]
        picked = logits if rows is None else logits[rows]
        params = [requests[i].sampling_params for i in sampled]
        generators = [requests[i].generator for i in sampled]
        filtered = [j for j, p in enumerate(params) if _filters(p, vocab)]
        plain = [j for j, p in enumerate(params) if not _filters(p, vocab)]
        temperature = floats["temperature"].unsqueeze(1)
        parts: list[tuple[str, torch.Tensor]] = []
        retry = None
        if filtered:
            sub = picked if not plain else picked[ints["filtered"]]
            settings = FilterSettings(temperature if not plain else temperature[ints["filtered"]],
                                      [_top_k(params[j], vocab) for j in filtered], floats["top_k"].unsqueeze(1),
                                      floats["top_p"].unsqueeze(1), floats["min_p"].unsqueeze(1))
            cands = candidate_filter(sub, settings)
            gens = [generators[j] for j in filtered]
            probs = cands.logits.softmax(dim=1)
            for j, generator in enumerate(gens):
                if generator is not None:  # a seeded row's floats as its whole masked row gives them, as before
                    probs[j] = cands.masked(vocab, j).softmax(dim=0)[cands.ids[j]]
            q, drawn = self._draws(gens, cands.ids, vocab)
            ratio = probs / q
            # the race's argmax over the vocabulary: among equal ratios the lowest id
            best = ratio.max(dim=1, keepdim=True).values
            parts.append(("filtered", torch.where(ratio == best, cands.ids, vocab).min(dim=1).values))
            retry = _Retry(cands.exact, [sampled[j] for j in filtered], sub, settings, gens, drawn)
        if plain:
            sub = picked if not filtered else picked[ints["plain"]]
            q, _ = self._draws([generators[j] for j in plain], None, vocab)
            scaled = sub / (temperature if not filtered else temperature[ints["plain"]])
            parts.append(("plain", (scaled.softmax(dim=-1) / q).argmax(dim=-1)))
        if len(parts) == 1 and rows is None:
            return parts[0][1], retry
        tokens = logits.argmax(dim=-1)
        for group, choice in parts:
            tokens[_batch_rows(rows, ints.get(group))] = choice
        return tokens, retry

    def _resample(self, tokens: torch.Tensor, retry: _Retry, undecided: list[int]) -> torch.Tensor:
        """The undecided filtered rows sampled over their whole sorted rows, with the draws a seeded
        row already took this step."""
        at = torch.tensor(undecided, device=tokens.device)
        probs = sort_filter(retry.logits[at], retry.settings.rows(undecided)).softmax(dim=-1)
        q, _ = self._draws([retry.generators[j] for j in undecided], None, probs.shape[1],
                           {i: retry.drawn[j] for i, j in enumerate(undecided) if j in retry.drawn})
        tokens = tokens.clone()
        tokens[torch.tensor([retry.rows[j] for j in undecided], device=tokens.device)] = (probs / q).argmax(dim=-1)
        return tokens

    def _draws(self, generators: list[torch.Generator | None], ids: torch.Tensor | None, vocab: int,
               drawn: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """q ~ Exp(1) at each row's ids (all the vocabulary when ids is None): unseeded rows in one
        draw from the engine's generator, a seeded row a whole vocabulary row from its own (or the
        row it already drew, from `drawn`), taken at its ids. Returns q and the seeded rows' draws."""
        width = vocab if ids is None else ids.shape[1]
        q = torch.empty(len(generators), width, dtype=torch.float32, device=self.device)
        if any(g is None for g in generators):
            # -log(1 - U) is Exp(1), at a sixth of exponential_'s cost on a CPU; never 0, or p / q is 0 / 0
            q.uniform_(generator=self.generator).neg_().log1p_().neg_().clamp_(min=TINY)
        drawn = dict(drawn or {})
        for j, generator in enumerate(generators):
            if generator is not None:
                if j not in drawn:
                    drawn[j] = q.new_empty(vocab).exponential_(generator=generator)
                q[j] = drawn[j] if ids is None else drawn[j][ids[j]]
        return q, drawn


def _counts(req: Request) -> PenaltyCounts:
    req.penalty_counts = req.penalty_counts or PenaltyCounts()
    return req.penalty_counts.update(req.token_ids, req.num_prompt_tokens)


def _top_k(params: SamplingParams, vocab: int) -> int:
    """The row's top_k, 0 when it keeps the whole vocabulary."""
    return params.top_k if 0 < params.top_k < vocab else 0


def _filters(params: SamplingParams, vocab: int) -> bool:
    return _top_k(params, vocab) > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _add_filter_settings(ints: HostBuffer, floats: HostBuffer, params: list[SamplingParams], vocab: int) -> None:
    """The sampled rows' temperatures, the filtered rows' settings and, when only some filter,
    which of the sampled rows do and which do not."""
    # fp32 rounds a temperature past its range (1e300) to inf, and a masked -inf over inf is NaN
    floats.add("temperature", [min(p.temperature, FLOAT32_MAX) for p in params])
    filtered = [j for j, p in enumerate(params) if _filters(p, vocab)]
    if not filtered:
        return
    floats.add("top_k", [_top_k(params[j], vocab) or vocab for j in filtered])
    floats.add("top_p", [params[j].top_p if params[j].top_p < 1.0 else math.inf for j in filtered])
    floats.add("min_p", [params[j].min_p for j in filtered])
    if len(filtered) < len(params):
        ints.add("filtered", filtered)
        ints.add("plain", [j for j, p in enumerate(params) if not _filters(p, vocab)])


def _batch_rows(sampled_rows: torch.Tensor | None, group: torch.Tensor | None) -> torch.Tensor | slice:
    """A group of the sampled rows as rows of the batch."""
    if group is None:
        return slice(None) if sampled_rows is None else sampled_rows
    return group if sampled_rows is None else sampled_rows[group]


def _logprob_rows(params: list[SamplingParams]) -> list[int]:
    """Rows asking for logprobs, ordered by how many alternatives (see _pack_logprobs)."""
    return sorted((i for i, p in enumerate(params) if p.logprobs is not None), key=lambda i: params[i].logprobs)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """logprobs: [R, V] log-softmax rows; row i's entry for tokens[i], with its rank and the
    num_top most likely tokens. One copy each way."""
    chosen = upload(array.array("q", tokens), torch.long, logprobs.device)
    num_tops = [num_top] * len(tokens)
    return _unpack_logprobs(_pack_logprobs(logprobs, chosen, num_tops).tolist(), tokens, num_tops)


def _pack_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_tops: list[int]) -> torch.Tensor:
    """One flat float64 tensor (exact for fp32 values and for ids): each row's chosen logprob, then
    each row's rank, then per row its num_tops[i] top ids followed by their logprobs. Rows with the
    same count must be adjacent: topk runs once per run of them, as a single row's topk would break
    ties (partial sorts differ with k)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    parts = [chosen.squeeze(1).double(), ((logprobs > chosen).sum(dim=1) + 1).double()]
    start = 0
    for num_top, run in itertools.groupby(num_tops):
        count = len(list(run))
        if num_top > 0:
            values, ids = logprobs[start:start + count].topk(num_top, dim=1)
            parts.append(torch.cat([ids.double(), values.double()], dim=1).flatten())
        start += count
    return torch.cat(parts)


def _unpack_logprobs(values: list[float], tokens: list[int], num_tops: list[int]) -> list[TokenLogprobs]:
    rows = len(tokens)
    entries, pos = [], 2 * rows
    for i, (token, num_top) in enumerate(zip(tokens, num_tops)):
        ids, tops = values[pos:pos + num_top], values[pos + num_top:pos + 2 * num_top]
        entries.append(TokenLogprobs(token, values[i], int(values[rows + i]), [(int(t), v) for t, v in zip(ids, tops)]))
        pos += 2 * num_top
    return entries


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
