"""SamplingParams(prompt_logprobs=N): HF's log-softmax at every prompt position, whole or chunked,
beside the prefix cache, and across a preemption; the first entry None, every block free after."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.engine.request import Request
from tiny_models import hf_prompt_logprobs, sample_prompts

TOP = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return sample_prompts(model_dir, 4, seed=21, max_len=70)


def assert_matches_hf(model_dir, prompt: list[int], entries) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert len(entries) == len(prompt) and entries[0] is None  # nothing predicts the first token
    for pos in range(1, len(prompt)):
        lp, row = entries[pos], ref[pos - 1]
        assert lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        target = row[prompt[pos]]  # its rank, allowing for ties within the tolerance
        assert int((row > target + 1e-4).sum()) + 1 <= lp.rank <= int((row >= target - 1e-4).sum())
        assert len(lp.top) == TOP
        assert [v for _, v in lp.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4)
        assert all(v == pytest.approx(row[t].item(), abs=1e-4) for t, v in lp.top)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}, {"enable_prefix_caching": False}],
                         ids=["whole", "chunked", "no_prefix_cache"])
def test_prompt_logprobs_match_hf(model_dir, prompts, options, monkeypatch):
    from roseinfer.worker.model_runner import LOGITS_CHUNK_ROWS

    llm = LLM(model=str(model_dir), num_kv_blocks=64, **options)
    model, rows = llm.engine.runner.model, []
    real_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: rows.append(hidden.shape[0]) or real_logits(hidden))
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert max(rows) <= LOGITS_CHUNK_ROWS < max(len(p) for p in prompts)  # a long prompt's logits in pieces
    assert max(len(p) for p in prompts) > 2 * llm.engine.config.max_num_batched_tokens or "max_num_batched_tokens" not in options
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(model_dir, prompt, out.prompt_logprobs)
        assert len(out.token_ids) == PARAMS.max_tokens and out.logprobs is None
    assert llm.kv_cache_stats()["used_blocks"] == 0
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_take_no_prefix_cache_hit_but_leave_their_blocks(model_dir, prompts):
    llm = LLM(model=str(model_dir), num_kv_blocks=64)
    first = max(prompts, key=len)
    llm.generate([first], PARAMS, use_tqdm=False)
    shared = first[:40] + prompts[0][:9]  # two full blocks in common
    out = llm.generate([shared], PARAMS, use_tqdm=False)[0]
    stats = llm.kv_cache_stats()
    assert out.num_cached_tokens == 0 and stats["prefix_cache_hits"] == 0
    assert_matches_hf(model_dir, shared, out.prompt_logprobs)
    # a request without prompt logprobs is served from the blocks those left in the cache
    assert llm.generate([shared], SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_prompt_logprobs_survive_a_preemption_without_being_taken_twice(model_dir, prompts):
    # 7 blocks of 16: the first request's decode runs out of blocks while the second is still in
    # its prompt, which is preempted and recomputed later
    llm = LLM(model=str(model_dir), num_kv_blocks=7, max_num_batched_tokens=16)
    longest = max(prompts, key=len)
    long_prompts = [longest[:60], longest[-60:]]
    assert len(longest) >= 61
    outs = llm.generate(long_prompts, PARAMS, use_tqdm=False)
    assert outs[1].metrics["num_preemptions"] > 0
    assert outs[1].num_cached_tokens > 0  # readmitted, the positions it had already taken came from the cache
    for prompt, out in zip(long_prompts, outs):
        assert_matches_hf(model_dir, prompt, out.prompt_logprobs)
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_the_prefix_cache_serves_only_positions_whose_prompt_logprobs_are_taken():
    req = Request("r", list(range(40)), PARAMS)
    assert req.max_prefix_hit == 0 and list(req.prompt_logprob_positions(16)) == list(range(16))
    req.prompt_logprobs += [None] * 20  # positions 0..19 taken (entries 1..20), then preempted
    assert req.max_prefix_hit == 20 and list(req.prompt_logprob_positions(32)) == list(range(20, 32))
    req.prompt_logprobs += [None] * 19  # the whole prompt, then 5 generated tokens
    req.token_ids += [1, 2, 3, 4, 5]
    assert req.max_prefix_hit == 44 and len(req.prompt_logprob_positions(45)) == 0
    assert Request("s", list(range(40)), SamplingParams()).max_prefix_hit == 39


def test_bad_prompt_logprobs_are_refused(model_dir):
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    llm = LLM(model=str(model_dir), num_kv_blocks=8)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    assert llm.kv_cache_stats()["used_blocks"] == 0
