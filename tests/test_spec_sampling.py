"""Speculative decoding of sampled requests: the tokens a verification emits follow the target's
processed distribution exactly (rejection sampling with a point-mass draft), and end to end sampled
requests speculate, finish, free their blocks and reproduce from a seed."""
from __future__ import annotations

import pytest
import torch
from tiny_models import sample_prompts

from roseinfer import LLM, SamplingParams
from roseinfer.engine.request import Request
from roseinfer.engine.sampler import Sampler
from roseinfer.engine.speculative import accept_draft

VOCAB = 6
TRIALS = 30_000
# chi-square critical value at significance 1e-3 for up to 5 degrees of freedom (df 5 is the largest)
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
# batches speculate too (the default stops above one sequence, where it stops paying on CPU)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 8}


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's distribution at one position, written out from the definitions: logit bias,
    temperature, then top-k."""
    x = logits.clone()
    for token, bias in params.logit_bias.items():
        x[token] += bias
    x = x / params.temperature
    if params.top_k > 0:
        x[x < x.topk(params.top_k).values[-1]] = float("-inf")
    return x.softmax(dim=-1)


def _chi_square(samples: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target filters out was emitted"
    want = expected[support].double() * len(samples)
    statistic = float(((counts[support] - want) ** 2 / want).sum())
    assert statistic < CHI2_CRITICAL[int(support.sum()) - 1], (counts.tolist(), want.tolist())


def test_verified_tokens_follow_the_target_distribution():
    """Fixed target logits at each of 1 + K positions and a fixed draft; many independent trials
    in one sampler call. The first emitted token follows p0, the second (emitted when d0 was
    accepted) p1, and the bonus token after all K acceptances p2."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=5, logit_bias={3: 1.5})
    logits = torch.randn(3, VOCAB) * 1.5
    draft = [int(logits[0].argmax()), int(logits[1].argsort()[-2])]  # one likely, one less likely draft token
    sampler = Sampler({0}, torch.device("cpu"), seed=1234)
    requests = [Request(f"r{t}", [1, 2, 3], params) for t in range(TRIALS) for _ in range(3)]
    tokens, _ = sampler(logits.repeat(TRIALS, 1), requests)
    emitted = [accept_draft(draft, tokens[3 * t:3 * t + 3]) for t in range(TRIALS)]
    p = [_target(row, params) for row in logits]
    _chi_square(torch.tensor([e[0] for e in emitted]), p[0])
    seconds = torch.tensor([e[1] for e in emitted if len(e) > 1])
    assert len(seconds) == pytest.approx(TRIALS * float(p[0][draft[0]]), rel=0.05)
    _chi_square(seconds, p[1])
    _chi_square(torch.tensor([e[2] for e in emitted if len(e) > 2]), p[2])
    # a rejected draft token never comes back as its own correction
    assert all(e[0] != draft[0] for e in emitted if len(e) == 1)


def _cyclic_prompts(model_dir) -> list[list[int]]:
    p = sample_prompts(model_dir, 4, seed=3)
    return [p[0][:3] * 12, p[1][:2] * 15, p[2][:4] * 8, p[3]]


SAMPLED = [SamplingParams(temperature=0.5, top_k=3, max_tokens=32, ignore_eos=True, seed=s) for s in (1, 2, 3, 4)]


def test_sampled_requests_speculate_finish_and_reproduce(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    prompts = _cyclic_prompts(model_dir)
    llm = LLM(model=str(model_dir), num_kv_blocks=64, speculative_config=NGRAM, max_num_batched_tokens=16)
    first = llm.generate(prompts, SAMPLED, use_tqdm=False)
    again = llm.generate(prompts, SAMPLED, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 32 and o.finish_reason == "length" for o in first)
    assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"
    assert llm.kv_cache_stats()["used_blocks"] == 0
    # unseeded sampled requests speculate too, and finish
    unseeded = SamplingParams(temperature=0.5, top_k=3, max_tokens=32, ignore_eos=True)
    assert all(len(o.token_ids) == 32 for o in llm.generate(prompts, unseeded, use_tqdm=False))
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_seeded_output_is_the_same_with_and_without_speculation(tiny_model_factory):
    """A seeded request's generator is rewound to one row of draws per emitted token
    (Sampler.rewind), so each position sees the draws it would see decoding one token a step,
    and the accepted draft is exactly what those draws pick."""
    model_dir = tiny_model_factory("llama")
    prompts = _cyclic_prompts(model_dir)
    spec = LLM(model=str(model_dir), num_kv_blocks=64, speculative_config=NGRAM)
    plain = LLM(model=str(model_dir), num_kv_blocks=64)
    got = spec.generate(prompts, SAMPLED, use_tqdm=False)
    want = plain.generate(prompts, SAMPLED, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.speculative_stats()["spec_num_accepted_tokens"] > 0
