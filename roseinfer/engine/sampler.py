"""Batched sampling: penalties, logit bias, min_tokens, temperature, top-k / top-p / min-p, seeds.

Greedy batches without penalties take one argmax. Sampled rows use the exponential race
(argmax of p / q with q ~ Exp(1)), which draws exactly from p; a request with a seed draws q
from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from typing import Callable

import torch

from roseinfer.engine.request import Request, TokenLogprobs

NEG_INF = float("-inf")


class Sampler:
    def __init__(self, eos_token_ids: set[int], device: torch.device, seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))  # a backend may bring a faster one
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] float32, one row per request; returns token ids and optional logprobs."""
        params = [r.sampling_params for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if all(p.greedy and not p.needs_penalties and not p.logit_bias for p in params) and \
                not any(self._masks_stops(r) for r in requests):
            tokens = self.argmax(logits)
        else:
            tokens = self._sample(logits.clone(), requests)
        token_list = tokens.tolist()
        logprobs = [token_logprobs(raw_logprobs[i:i + 1], [tok], p.logprobs)[0] if p.logprobs is not None else None
                    for i, (tok, p) in enumerate(zip(token_list, params))]
        return token_list, logprobs

    def _masks_stops(self, req: Request) -> bool:
        return req.num_output_tokens < req.sampling_params.min_tokens

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, req in enumerate(requests):
            self._process_row(logits, i, req)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [requests[i].sampling_params for i in sampled_rows])
            race = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(sampled_rows) if requests[i].generator is None]
            if unseeded:
                race[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self.generator)
            for j, i in enumerate(sampled_rows):
                if requests[i].generator is not None:
                    race[j] = torch.empty_like(probs[j]).exponential_(generator=requests[i].generator)
            tokens[rows] = (probs / race).argmax(dim=-1)
        return tokens

    def _process_row(self, logits: torch.Tensor, i: int, req: Request) -> None:
        p = req.sampling_params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            # HF / vLLM definition over prompt and output: positive logits divided, negative multiplied.
            seen = torch.tensor(sorted(set(req.token_ids)), device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            # OpenAI definition over generated tokens: logit -= f * count + p * (count > 0).
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.numel())[: row.numel()].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        if self._masks_stops(req):
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if banned:
                row[torch.tensor(banned, device=row.device)] = NEG_INF

    def _filtered_probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), NEG_INF)
            probs = sorted_logits.softmax(dim=-1)
            top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=logits.device)
            min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=logits.device)
            # keep a token while the mass before it is below top_p; the most likely one always stays
            drop = (probs.cumsum(dim=-1) - probs) > top_p.unsqueeze(1)
            drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """logprobs: [R, V] log-softmax rows; row i's entry for tokens[i], with its rank and the
    num_top most likely tokens."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprobs(token, value, rank, top)
            for token, value, rank, top in zip(tokens, chosen.squeeze(1).tolist(), ranks, tops)]
