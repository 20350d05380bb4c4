"""Sampling: seeds, top-k, penalties and logit bias by their definitions, stop ids, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.engine.request import Request
from roseinfer.engine.sampler import PENALIZED_LIMIT, Sampler
from roseinfer.engine.sampling_filters import FilterSettings, candidate_filter
from tiny_models import sample_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompts(tiny_model_factory):
    return sample_prompts(tiny_model_factory("llama"), 6, seed=5)


def _sample(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, **kw})


def test_seed_reproducible_alone_and_in_mixed_batch(llm, prompts):
    alone = llm.generate([prompts[0]], _sample(seed=7))[0].token_ids
    mixed = llm.generate(prompts, [_sample(seed=7)] + [_sample() for _ in prompts[1:]])[0].token_ids
    assert alone == mixed
    assert llm.generate([prompts[0]], _sample(seed=8))[0].token_ids != alone


def test_top_k_1_equals_greedy(llm, prompts):
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    top1 = llm.generate(prompts, _sample(top_k=1, temperature=0.8))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_token_ids_and_min_tokens(llm, prompts):
    greedy = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"
    masked = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=[stop_id], min_tokens=12))[0]
    assert stop_id not in masked.token_ids and len(masked.token_ids) == 12 and masked.finish_reason == "length"


def test_logprobs_match_log_softmax(llm, prompts):
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for lp, token in zip(out.logprobs, out.token_ids):
        assert lp.token_id == token and lp.rank == 1  # greedy picks the most likely token
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0


def _processed(params: SamplingParams, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    req = Request("r", prompt, params)
    req.token_ids.extend(output)
    sampler = Sampler(eos_token_ids={0}, device=torch.device("cpu"), seed=0)
    row = logits.clone().unsqueeze(0)
    return sampler._process(row, *sampler._inputs([req], row.shape[1], row.device))[0]


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, output = [1], [3, 3, 2]
    rep = _processed(SamplingParams(repetition_penalty=2.0), logits, prompt, output)
    assert rep.tolist() == [2.0, -2.0, 0.25, 1.5, -2.0]  # seen tokens 1, 2, 3; positive /2, negative *2
    freq = _processed(SamplingParams(frequency_penalty=0.5), logits, prompt, output)
    assert freq.tolist() == [2.0, -1.0, 0.0, 2.0, -2.0]  # output counts: token 3 twice, token 2 once
    pres = _processed(SamplingParams(presence_penalty=0.5), logits, prompt, output)
    assert pres.tolist() == [2.0, -1.0, 0.0, 2.5, -2.0]
    bias = _processed(SamplingParams(logit_bias={4: 10.0}), logits, prompt, output)
    assert bias.tolist() == [2.0, -1.0, 0.5, 3.0, 8.0]
    eos_masked = _processed(SamplingParams(min_tokens=5, max_tokens=8), logits, prompt, output)
    assert eos_masked[0] == float("-inf") and eos_masked[1:].tolist() == logits[1:].tolist()


def test_extreme_repetition_penalties_keep_logits_finite():
    # fp32 rounds 5e-324 to 0 and 1e300 to inf: unclamped, 3 / 0 was inf and a masked -inf times 0 NaN
    logits = torch.tensor([2.0, -1.0, float("-inf"), 3.0, 0.0])
    prompt, output = [1, 2], [3, 4]
    tiny = _processed(SamplingParams(repetition_penalty=5e-324), logits, prompt, output)
    assert not tiny.isnan().any()
    assert tiny[0] == 2.0 and tiny[2] == float("-inf") and tiny[4] == 0.0
    assert tiny[3] == torch.tensor(PENALIZED_LIMIT) and -1e-37 < tiny[1] < 0  # 3 / 0 saturates; -1 * TINY
    huge = _processed(SamplingParams(repetition_penalty=1e300), logits, prompt, output)
    assert not huge.isnan().any()
    assert huge[1] == -torch.finfo(torch.float32).max and 0 < huge[3] < 1e-37 and huge[4] == 0.0


def test_a_vanishing_repetition_penalty_samples_in_the_vocabulary(llm, prompts):
    vocab = llm.engine.model_config.vocab_size
    params = _sample(repetition_penalty=5e-324, top_k=50, min_p=0.5, logprobs=1, seed=3)
    for out in llm.generate(prompts[:3], params):
        assert len(out.token_ids) == 12 and all(0 <= t < vocab for t in out.token_ids)
        assert all(math.isfinite(lp.logprob) for lp in out.logprobs)


def test_a_temperature_past_fp32_samples_the_allowed_tokens(llm, prompts):
    # fp32 rounds 1e300 to inf: a masked -inf over it was NaN, and every row then drew token 0
    for extra in ({}, {"top_k": 5}):
        params = _sample(temperature=1e300, stop_token_ids=[0], min_tokens=12, seed=4, **extra)
        for out in llm.generate(prompts[:3], params):
            assert 0 not in out.token_ids and len(set(out.token_ids)) > 1


def test_top_p_and_min_p_keep_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    col = lambda x: torch.tensor([[x]])  # noqa: E731
    kept = candidate_filter(logits, FilterSettings(col(1.0), [0], col(4.0), col(0.7), col(0.0))).logits > float("-inf")
    assert kept.tolist() == [[True, True, False, False]]  # the mass before the third is 0.8
    kept = candidate_filter(logits, FilterSettings(col(1.0), [0], col(4.0), col(math.inf), col(0.4))).logits > float("-inf")
    assert kept.tolist() == [[True, True, False, False]]  # keeps p >= 0.2


def test_seeded_sampling_and_logprobs_are_the_same_in_logit_chunks(llm, prompts, monkeypatch):
    # Seeded requests draw from their own generators and logprobs are per row, so sampling the
    # batch 4 rows at a time (worker/model_runner.py) must give exactly what one pass gives.
    from roseinfer.worker import model_runner

    params = [_sample(seed=40 + i, logprobs=2, top_p=0.9) for i in range(len(prompts))]
    whole = llm.generate(prompts, params)
    monkeypatch.setattr(model_runner, "LOGITS_CHUNK_ROWS", 4)
    chunked = llm.generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert [o.logprobs for o in chunked] == [o.logprobs for o in whole]
    assert len({tuple(o.token_ids) for o in whole}) > 1
