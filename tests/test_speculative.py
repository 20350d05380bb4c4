"""Speculative decoding by n-gram prompt lookup: greedy output equals HF's token for token with
drafts verified inside continuous batching, and the KV pool is whole afterwards."""
from __future__ import annotations

import argparse
import json

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig, SpeculativeConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.engine.speculative import accept_draft, ngram_lookup
from roseinfer.engine_args import add_engine_args, engine_config_from_args
from tiny_models import hf_greedy, sample_prompts

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# batches speculate too (the default stops above one sequence, where it stops paying on CPU)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 8}

MODES = {
    "default": {},
    "token_budget_8": {"max_num_batched_tokens": 8},
    # 10: under LongRoPE a sequence growing past its original context gives its blocks back to be
    # recomputed (no preemption), which left 12 blocks enough for phi3_longrope
    "preemption": {"num_kv_blocks": 10},
    "no_prefix_cache_no_chunking": {"enable_prefix_caching": False, "enable_chunked_prefill": False},
    "torch_backend": {"attention_backend": "torch"},
}


def _prompts(model_dir) -> list[list[int]]:
    """Short cycles, whose continuations tiny random models tend to repeat (so drafts are accepted),
    then two plain prompts."""
    p = sample_prompts(model_dir, 6, seed=3)
    return [p[0][:3] * 12, p[1][:2] * 15, p[2][:4] * 8, p[3][:5] * 6, p[4], p[5]]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    prompts = _prompts(tiny_model_dir)
    return prompts, [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in prompts]


def _llm(model_dir, **options) -> LLM:
    return LLM(model=str(model_dir), **{"num_kv_blocks": 128, "speculative_config": NGRAM, **options})


@pytest.mark.parametrize("mode", list(MODES))
def test_ngram_greedy_matches_hf(tiny_model_dir, references, mode):
    prompts, refs = references
    llm = _llm(tiny_model_dir, **MODES[mode])
    # two calls, so the second's prompts find the first's cached blocks
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False) + llm.generate(prompts[3:], GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} differs in mode {mode}"
        assert out.finish_reason == "length"
    assert llm.kv_cache_stats()["used_blocks"] == 0
    stats = llm.speculative_stats()
    assert stats["spec_num_accepted_tokens"] > 0, "no draft was ever accepted: the test proves nothing"
    assert stats["spec_mean_accepted_length"] > 1
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"


def test_mixed_batch_with_requests_that_do_not_speculate(tiny_model_dir, references):
    """Logprobs and penalties leave a request out of speculation, in the same steps as speculating
    ones (greedy and a seeded sampled one); each gives what it gives without speculation."""
    prompts, refs = references
    others = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)]
    prompts = prompts + prompts[4:5]
    params = [GREEDY] * 4 + others
    spec = _llm(tiny_model_dir, max_num_batched_tokens=16)
    plain = LLM(model=str(tiny_model_dir), num_kv_blocks=128, max_num_batched_tokens=16)
    got = spec.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    for i in range(4):
        assert got[i].token_ids == refs[i]
    for i in range(4, 7):
        assert got[i].token_ids == want[i].token_ids
    assert [(lp.token_id, lp.rank) for lp in got[4].logprobs] == [(lp.token_id, lp.rank) for lp in want[4].logprobs]
    assert [lp.logprob for lp in got[4].logprobs] == pytest.approx([lp.logprob for lp in want[4].logprobs], abs=1e-4)
    assert spec.speculative_stats()["spec_num_accepted_tokens"] > 0
    assert spec.kv_cache_stats()["used_blocks"] == 0


def _step_deltas(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    deltas = []
    while engine.has_unfinished():
        deltas += [o.new_token_ids for o in engine.step() if o.request_id == rid]
    engine.pop_finished_ids()
    return deltas


@pytest.mark.parametrize("limit", ["stop_token_ids", "max_tokens"])
def test_stop_inside_an_accepted_run_ends_exactly_there(tiny_model_factory, monkeypatch, limit):
    """An oracle proposer (the HF continuation) makes every draft accepted whole, so a stop can fall
    inside a run: the request ends at the stop and emits nothing past it."""
    from roseinfer.engine import speculative

    model_dir = tiny_model_factory("qwen3")
    prompt = sample_prompts(model_dir, 1, seed=5)[0]
    ref = hf_greedy(model_dir, prompt, MAX_TOKENS)
    monkeypatch.setattr(speculative, "ngram_lookup", lambda tokens, n_min, n_max, k:
                        ref[len(tokens) - len(prompt):len(tokens) - len(prompt) + k])
    # after the prefill's token, steps emit 5 at a time (positions 1-5, 6-10 ...): not a step's last
    position = next(j for j in range(2, MAX_TOKENS) if ref[j] not in ref[:j] and j % 5)
    if limit == "stop_token_ids":
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[position]])
    else:
        params = SamplingParams(temperature=0.0, max_tokens=position + 1, ignore_eos=True)
    llm = _llm(model_dir)
    deltas = _step_deltas(llm, prompt, params)
    assert [t for d in deltas for t in d] == ref[:position + 1]
    assert len(deltas[-1]) == (position - 1) % 5 + 1 > 1  # cut short inside an accepted run
    assert llm.engine.speculative_stats()["spec_num_accepted_tokens"] > 0
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_abort_mid_speculation_frees_everything(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    llm = _llm(model_dir, enable_prefix_caching=False)
    engine = llm.engine
    rid = engine.add_request(_prompts(model_dir)[0], GREEDY)
    while engine.speculative_stats()["spec_num_accepted_tokens"] == 0:
        engine.step()
    assert engine.get_request(rid).block_table
    assert engine.abort_request(rid)
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_large_batches_do_not_speculate(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    llm = _llm(model_dir, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    prompts = _prompts(model_dir)[:4]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.speculative_stats()["spec_num_drafts"] == 0
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]


def test_failed_proposals_back_off():
    """A request whose drafts all fail pauses 1, 2, 4 ... steps before proposing again."""
    from roseinfer.engine.speculative import NgramProposer

    proposer = NgramProposer(SpeculativeConfig(), max_model_len=1000)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], GREEDY)
    pauses = []
    for _ in range(3):
        assert proposer.propose([req])[0]
        proposer.record(req, 4, 0)
        pauses.append(req.spec_pause)
        while req.spec_pause:
            assert proposer.propose([req]) == [[]]
    assert pauses == [1, 2, 4]
    proposer.record(req, 4, 2)
    assert req.spec_misses == 0 and proposer.stats.num_draft_tokens == 16


def test_ngram_lookup():
    # the most recent occurrence of the longest suffix with k tokens after it
    assert ngram_lookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], 1, 3, 2) == [5, 6]
    assert ngram_lookup([5, 1, 2, 3, 4, 2, 3], 1, 3, 3) == [4, 2, 3]
    assert ngram_lookup([1, 2, 3], 1, 3, 4) == []
    assert ngram_lookup([7, 7], 1, 1, 4) == [7]  # a continuation shorter than k is all there is
    assert ngram_lookup([1, 2, 1, 9, 1], 2, 2, 3) == []  # below prompt_lookup_min


def test_accept_draft():
    assert accept_draft([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the bonus token
    assert accept_draft([4, 5, 6], [4, 8, 6, 7]) == [4, 8]
    assert accept_draft([4, 5, 6], [9, 5, 6, 7]) == [9]


def test_shrink_gives_back_rejected_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = Request("r", list(range(6)), GREEDY)
    assert bm.append_slots(req, 11)  # 6 tokens + a 5-token verification chunk: 3 blocks
    req.num_computed_tokens = 7
    bm.shrink(req)
    assert len(req.block_table) == 2 and bm.num_free_blocks == 6
    bm.free(req)
    assert bm.num_used_blocks == 0


def test_speculative_config_from_dict_json_and_flag():
    assert EngineConfig(speculative_config=NGRAM).speculative == SpeculativeConfig(**NGRAM)
    assert EngineConfig(speculative_config=json.dumps(NGRAM)).speculative.prompt_lookup_max == 3
    assert EngineConfig().speculative is None
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"num_tokens": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_config_from_args(args).speculative.num_speculative_tokens == 4
