"""Batched sampling: grammar masks, penalties, logit bias, min_tokens, temperature, top-k / top-p /
min-p, seeds.

Greedy batches without penalties take one argmax. Otherwise every step works on the whole
[N, V] block on the logits' device: what it needs from the host (token ids, settings) is gathered
first and copied in one transfer per dtype, and what comes back (tokens, logprobs) in one.
Sampled rows use the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly from
p; a request with a seed draws q from its own generator, so its tokens do not depend on what else
is in the batch.
"""
from __future__ import annotations

import array
import itertools
import math
from typing import Callable

import torch

from roseinfer.engine.request import Request, TokenLogprobs
from roseinfer.engine.structured_output import GrammarMasks
from roseinfer.sampling_params import SamplingParams

NEG_INF = float("-inf")
Argmax = Callable[[torch.Tensor], torch.Tensor]
Tensors = dict[str, torch.Tensor]
PROCESSED_BY = ("seen", "output", "bias_ids", "banned")  # the id sections _process applies


class Sampler:
    def __init__(self, eos_token_ids: set[int], device: torch.device, seed: int, argmax: Argmax | None = None) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        # the greedy fast path's row argmax; on CPU the caller passes a C kernel (~10x torch's on [64, 49152])
        self.argmax = argmax or _torch_argmax
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammar_masks: GrammarMasks | None = None  # made on the first constrained row

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] float32, one row per request; returns token ids and optional logprobs."""
        params = [r.sampling_params for r in requests]
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            # before everything else, logprobs included: what a constrained row reports is its grammar's choice
            self.grammar_masks = self.grammar_masks or GrammarMasks()
            logits = self.grammar_masks.apply(logits, constrained, [requests[i].grammar for i in constrained])
        ints, floats = self._inputs(requests, logits.shape[1], logits.device)
        if all(p.greedy for p in params) and not any(name in ints for name in PROCESSED_BY):
            tokens = self.argmax(logits)
        else:
            tokens = self._sample(self._process(logits, ints, floats), requests, ints)
        order = _logprob_rows(params)
        if not order:
            return tokens.tolist(), [None] * len(requests)
        rows = ints.get("logprob_rows")
        raw = logits if rows is None else logits[rows]
        chosen = tokens if rows is None else tokens[rows]
        num_tops = [params[i].logprobs for i in order]
        packed = _pack_logprobs(torch.log_softmax(raw, dim=-1), chosen, num_tops)
        values = torch.cat([tokens.to(packed.dtype), packed]).tolist()  # the step's one device-to-host copy
        token_list = [int(v) for v in values[:len(requests)]]
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        entries = _unpack_logprobs(values[len(requests):], [token_list[i] for i in order], num_tops)
        for i, entry in zip(order, entries):
            logprobs[i] = entry
        return token_list, logprobs

    def rewind(self, generator: torch.Generator, state: torch.Tensor, num_kept: int, vocab: int) -> None:
        """Set a seeded request's generator to `state` advanced by num_kept rows of draws, as _race
        draws them: after a verification it has drawn one row per token emitted, as one token a step
        would have, so its output does not depend on how many draft rows were drawn and rejected."""
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
        ints, floats = _HostBuffer("q"), _HostBuffer("f")
        if any(p.repetition_penalty != 1.0 for p in params):
            # duplicates are harmless: each copy of an id writes the same value back
            ints.add_rows("seen", [r.token_ids if r.sampling_params.repetition_penalty != 1.0 else []
                                   for r in requests], vocab)
            floats.add("repetition", [p.repetition_penalty for p in params])
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            ints.add_rows("output", [r.output_token_ids if r.sampling_params.frequency_penalty or
                                     r.sampling_params.presence_penalty else [] for r in requests], vocab)
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
        unseeded = [j for j, i in enumerate(sampled) if requests[i].generator is None]
        if 0 < len(unseeded) < len(sampled):
            ints.add("unseeded", unseeded)
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
            # HF / vLLM definition over prompt and output: positive logits divided, negative multiplied
            seen, penalty = ints["seen"], floats["repetition"].unsqueeze(1)
            values = work.gather(1, seen)
            work.scatter_(1, seen, torch.where(values > 0, values / penalty, values * penalty))
        if "output" in ints:
            # OpenAI definition over generated tokens: logit -= f * count + p * (count > 0)
            out = ints["output"]
            # each id's count within its row, from the row sorted: no [N, V] count buffer
            ordered = out.sort(dim=1).values
            counts = (torch.searchsorted(ordered, out, right=True) - torch.searchsorted(ordered, out)).to(work.dtype)
            delta = floats["frequency"].unsqueeze(1) * counts + \
                floats["presence"].unsqueeze(1) * (counts > 0).to(work.dtype)
            work.scatter_(1, out, work.gather(1, out) - delta)
        if "bias_ids" in ints:
            work.scatter_(1, ints["bias_ids"], work.gather(1, ints["bias_ids"]) + floats["bias"])
        if "banned" in ints:
            work.scatter_(1, ints["banned"], NEG_INF)
        return work[:, :vocab]

    def _process_row(self, logits: torch.Tensor, i: int, req: Request) -> None:
        """Row i of logits for req alone, in place: the definitions one request's tests check."""
        logits[i] = self._process(logits[i:i + 1], *self._inputs([req], logits.shape[1], logits.device))[0]

    def _sample(self, logits: torch.Tensor, requests: list[Request], ints: Tensors) -> torch.Tensor:
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not sampled:
            return logits.argmax(dim=-1)
        rows = ints.get("sampled_rows")
        probs = self._filtered_probs(logits if rows is None else logits[rows],
                                     [requests[i].sampling_params for i in sampled])
        race = self._race(probs, [requests[i].generator for i in sampled], ints.get("unseeded"))
        choice = (probs / race).argmax(dim=-1)
        if rows is None:
            return choice
        tokens = logits.argmax(dim=-1)
        tokens[rows] = choice
        return tokens

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None],
              unseeded: torch.Tensor | None) -> torch.Tensor:
        """q ~ Exp(1) for each row: unseeded rows in one draw from the engine's generator (in row
        order), each seeded row from its own."""
        race = torch.empty_like(probs)
        if all(g is None for g in generators):
            return race.exponential_(generator=self.generator)
        if unseeded is not None:
            race[unseeded] = probs.new_empty(unseeded.numel(), probs.shape[1]).exponential_(generator=self.generator)
        for j, generator in enumerate(generators):
            if generator is not None:
                race[j].exponential_(generator=generator)
        return race

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        settings = array.array("f", [x for p in params for x in (
            p.temperature, p.top_p, p.min_p, min(p.top_k, vocab) if p.top_k > 0 else vocab)])
        temps, top_p, min_p, top_k = _upload(settings, torch.float32, logits.device).view(len(params), 4).T.unsqueeze(2)
        logits = logits / temps
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= top_k, NEG_INF)  # exact in fp32: vocab < 2**24
            probs = sorted_logits.softmax(dim=-1)
            # keep a token while the mass before it is below top_p; the most likely one always stays
            drop = (probs.cumsum(dim=-1) - probs) > top_p
            drop |= probs < min_p * probs[:, :1]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def _logprob_rows(params: list[SamplingParams]) -> list[int]:
    """Rows asking for logprobs, ordered by how many alternatives (see _pack_logprobs)."""
    return sorted((i for i, p in enumerate(params) if p.logprobs is not None), key=lambda i: params[i].logprobs)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """logprobs: [R, V] log-softmax rows; row i's entry for tokens[i], with its rank and the
    num_top most likely tokens. One copy each way."""
    chosen = _upload(array.array("q", tokens), torch.long, logprobs.device)
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


class _HostBuffer:
    """Named sections of one dtype gathered in one host array, moved to the device in one copy
    and handed back as views ("q": int64, "f": float32)."""

    def __init__(self, typecode: str) -> None:
        self.values = array.array(typecode)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, values: list) -> None:
        self.shapes[name] = (len(values),)
        self.values.extend(values)

    def add_rows(self, name: str, rows: list[list], pad: int | float) -> None:
        """Rows padded with pad to the longest one."""
        width = max(map(len, rows))
        self.shapes[name] = (len(rows), width)
        for row in rows:
            self.values.extend(row)
            self.values.extend([pad] * (width - len(row)))

    def upload(self, dtype: torch.dtype, device: torch.device) -> Tensors:
        if not self.shapes:
            return {}
        flat, start, views = _upload(self.values, dtype, device), 0, {}
        for name, shape in self.shapes.items():
            views[name] = flat[start:start + math.prod(shape)].view(shape)
            start += math.prod(shape)
        return views


def _upload(values: array.array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host-to-device copy (none on CPU); from pinned memory on CUDA, so it does not block."""
    host = torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
