"""The batched sampler: a row's result does not depend on its batch, the processed logits match a
per-row reading of each definition, and a step moves data to the host once."""
from __future__ import annotations

import collections
from typing import Callable

import pytest
import torch

from roseinfer.engine.request import Request, TokenLogprobs
from roseinfer.engine.sampler import Sampler, token_logprobs
from roseinfer.engine.sampling_filters import PROBE
from roseinfer.sampling_params import SamplingParams

VOCAB = 1000
EOS = 2
CPU = torch.device("cpu")
# every feature, one row each or mixed; seeded and greedy rows must not depend on the batch
SPECS: list[dict] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
    {"seed": 1, "top_k": 20, "frequency_penalty": 0.7, "presence_penalty": -0.4, "logprobs": 5},
    {"seed": 2, "top_p": 0.8, "min_p": 0.05, "logit_bias": {5: 4.5, 17: -3.25, 999: 1.0}},
    {"seed": 3, "temperature": 0.7, "min_tokens": 12, "max_tokens": 13, "stop_token_ids": [11, 12]},
    {"temperature": 1.2, "top_k": 50, "repetition_penalty": 0.8, "logprobs": 0},
    {"seed": 4, "repetition_penalty": 1.7, "frequency_penalty": 1.1, "logit_bias": {3: 2.0}, "min_tokens": 20,
     "max_tokens": 30, "ignore_eos": True, "stop_token_ids": [7], "top_p": 0.9, "logprobs": 3},
    {"temperature": 0.0, "min_tokens": 18, "max_tokens": 20, "logprobs": 5},
    {"temperature": 0.9, "presence_penalty": 1.5, "min_p": 0.1},
]


def _request(i: int, spec: dict) -> Request:
    """Row i's request: a prompt and 2 i + 2 generated tokens (with repeats), a fresh generator if seeded."""
    params = SamplingParams(**spec)
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    prompt = [(37 * i + 11 * j) % VOCAB for j in range(5 + i)]
    req = Request(f"r{i}", prompt, params, generator=generator)
    req.token_ids.extend([(3 * i + j) % 40 for j in range(2 * i)] + [i, i])
    return req


def _logits(n: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) * 4


def _reference_processed(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Each definition read element by element, in fp32 like the sampler's settings."""
    p, row = req.sampling_params, row.clone()
    f32: Callable[[float], torch.Tensor] = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    if p.repetition_penalty != 1.0:
        for t in set(req.token_ids):
            row[t] = row[t] / f32(p.repetition_penalty) if row[t] > 0 else row[t] * f32(p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        for t, count in collections.Counter(req.output_token_ids).items():
            row[t] = row[t] - (f32(p.frequency_penalty) * count + f32(p.presence_penalty))
    for t, bias in p.logit_bias.items():
        row[t] = row[t] + f32(bias)
    if req.num_output_tokens < p.min_tokens:
        for t in p.stop_token_ids + ([] if p.ignore_eos else [EOS]):
            row[t] = float("-inf")
    return row


def _reference_logprobs(row: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    lp = torch.log_softmax(row, dim=-1)
    values, ids = lp.topk(num_top)
    return TokenLogprobs(token, lp[token].item(), int((lp > lp[token]).sum()) + 1,
                         list(zip(ids.tolist(), values.tolist())))


def test_processed_logits_follow_each_definition_per_row():
    requests = [_request(i, spec) for i, spec in enumerate(SPECS)]
    logits = _logits(len(SPECS))
    sampler = Sampler({EOS}, CPU, seed=0)
    processed = sampler._process(logits, *sampler._inputs(requests, VOCAB, CPU))
    expected = torch.stack([_reference_processed(logits[i], r) for i, r in enumerate(requests)])
    assert torch.equal(processed, expected)
    assert ((processed != logits).sum(dim=1) > 0).tolist() == [False] + [True] * 8  # all but row 0 process
    assert processed.isinf().sum(dim=1).tolist() == [0, 0, 0, 0, 3, 0, 1, 1, 0]  # the stop masks


@pytest.mark.parametrize("order", [list(range(len(SPECS))), list(reversed(range(len(SPECS)))), [6, 2, 0, 3]])
def test_seeded_and_greedy_rows_give_in_a_batch_what_they_give_alone(order: list[int]):
    logits = _logits(len(SPECS))[order]
    sampler = Sampler({EOS}, CPU, seed=0)
    batch = [_request(i, SPECS[i]) for i in order]
    tokens, logprobs = sampler(logits, batch)
    checked = 0
    for row, (i, req) in enumerate(zip(order, batch)):
        p = req.sampling_params
        assert _reference_processed(logits[row], req)[tokens[row]] > float("-inf")  # never a masked token
        if p.logprobs is not None:
            assert logprobs[row] == _reference_logprobs(logits[row], tokens[row], p.logprobs)
        else:
            assert logprobs[row] is None
        if p.seed is not None or p.greedy:
            alone = Sampler({EOS}, CPU, seed=123)(logits[row:row + 1], [_request(i, SPECS[i])])
            assert (tokens[row], logprobs[row]) == (alone[0][0], alone[1][0])
            checked += 1
    assert checked >= 3


def test_each_generator_advances_as_one_draw_per_row():
    # the engine's generator takes one draw per group of rows with an unseeded one (the filtered rows
    # at their candidates, here the nine rows' widest: PROBE), a seeded row one vocabulary row from
    # its own: what the exponential race needs for "same output alone or in any batch"
    sampler = Sampler({EOS}, CPU, seed=5)
    batch = [_request(i, SPECS[i]) for i in range(len(SPECS))]
    sampler(_logits(len(SPECS)), batch)
    filtered = sum(1 for r in batch if not r.sampling_params.greedy and r.sampling_params.seed != 3)
    engine = torch.Generator().manual_seed(5)
    torch.empty(filtered, PROBE).uniform_(generator=engine)  # the plain row (seed 3) is seeded
    assert torch.equal(sampler.generator.get_state(), engine.get_state())
    for i, req in enumerate(batch):
        if req.generator is not None:
            own = torch.Generator().manual_seed(req.sampling_params.seed)
            torch.empty(VOCAB).exponential_(generator=own)
            assert torch.equal(req.generator.get_state(), own.get_state()), i


SYNCS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")
UPLOADS = ("tensor", "as_tensor", "frombuffer")


def _count(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts device-to-host reads (Tensor methods) and tensors built from host data (torch
    functions) from here on."""
    calls: collections.Counter = collections.Counter()

    def counting(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    for name in SYNCS:
        counting(torch.Tensor, name)
    for name in UPLOADS:
        counting(torch, name)
    return calls


def _step_calls(monkeypatch: pytest.MonkeyPatch, specs: list[dict]) -> collections.Counter:
    sampler = Sampler({EOS}, CPU, seed=0)
    requests = [_request(i, spec) for i, spec in enumerate(specs)]
    logits = _logits(len(specs))
    with monkeypatch.context() as patch:
        calls = _count(patch)
        sampler(logits, requests)
    return calls


def test_a_step_reads_the_device_once(monkeypatch):
    without_logprobs = [{k: v for k, v in spec.items() if k != "logprobs"} for spec in SPECS]
    calls = _step_calls(monkeypatch, without_logprobs)
    assert sum(calls[name] for name in SYNCS) == 1, calls
    calls = _step_calls(monkeypatch, SPECS)
    assert sum(calls[name] for name in SYNCS) == 1, calls  # tokens and logprobs packed together
    # host data goes up once per dtype and per use (ids, penalty settings, filter settings),
    # however many rows the batch has
    uploads = sum(calls[name] for name in UPLOADS)
    assert uploads <= 3 and sum(_step_calls(monkeypatch, SPECS * 4)[name] for name in UPLOADS) == uploads


def test_token_logprobs_reads_the_device_once(monkeypatch):
    lp = torch.log_softmax(_logits(6), dim=-1)
    targets = [3, 1, 4, 1, 5, 9]
    with monkeypatch.context() as patch:
        calls = _count(patch)
        entries = token_logprobs(lp, targets, 4)
    assert sum(calls[name] for name in SYNCS) == 1, calls
    assert entries == [_reference_logprobs(_logits(6)[i], t, 4) for i, t in enumerate(targets)]


def test_injected_argmax_takes_greedy_batches_without_processing():
    seen: list[torch.Tensor] = []

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        return torch.argmax(logits, dim=-1)
    sampler = Sampler({EOS}, CPU, seed=0, argmax=argmax)
    logits = _logits(3)
    greedy = [{"temperature": 0.0}, {"temperature": 0.0, "logprobs": 1}, {"temperature": 0.0, "min_tokens": 10, "max_tokens": 10}]
    tokens, _ = sampler(logits, [_request(i, spec) for i, spec in enumerate(greedy[:2])])
    assert len(seen) == 1 and tokens == logits[:2].argmax(dim=-1).tolist()
    sampler(logits, [_request(i, spec) for i, spec in enumerate(greedy)])  # the stop mask: no fast path
    assert len(seen) == 1


def test_logprobs_break_ties_as_a_row_alone():
    # topk orders tied values differently for different k, so each count of alternatives gets its own
    logits = (_logits(6) * 2).round() / 2
    specs = [{"temperature": 0.0, "logprobs": n} for n in (3, 20, 1, 3, 0, 20)]
    tokens, logprobs = Sampler({EOS}, CPU, seed=0)(logits, [_request(i, s) for i, s in enumerate(specs)])
    assert logprobs == [_reference_logprobs(logits[i], tokens[i], s["logprobs"]) for i, s in enumerate(specs)]
