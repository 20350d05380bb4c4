"""Speculative decoding with a draft model: greedy output equals HF's token for token under chunked
prefill and preemption, sampled seeded output equals the non-speculative one, both KV pools are
whole afterwards, and a draft with another vocabulary is refused."""
from __future__ import annotations

import json
import shutil

import pytest
from bench_helpers import benchmark_script
from tiny_models import hf_greedy, sample_prompts

from roseinfer import LLM, SamplingParams
from roseinfer.config import SpeculativeConfig

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TARGET = "llama"
MODES = {
    "default": {},
    "chunked_prefill_budget_8": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 10},
}


def _prompts(model_dir) -> list[list[int]]:
    p = sample_prompts(model_dir, 5, seed=4)
    return [p[0][:3] * 10, p[1], p[2], p[3][:5] * 5, p[4]]


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    model_dir = tiny_model_factory(TARGET)
    prompts = _prompts(model_dir)
    return model_dir, prompts, [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]


def _llm(model_dir, draft_dir, **options) -> LLM:
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 8}  # batches draft too
    return LLM(model=str(model_dir), **{"num_kv_blocks": 64, "speculative_config": spec, **options})


def _check_pools_whole(llm: LLM) -> None:
    assert llm.kv_cache_stats()["used_blocks"] == 0
    assert llm.engine.scheduler.proposer.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_draft_model_greedy_matches_hf(target, mode):
    """The target as its own draft: every draft is accepted, so each step emits K + 1 tokens and
    stops, chunk boundaries and preemption all fall inside accepted runs."""
    model_dir, prompts, refs = target
    llm = _llm(model_dir, model_dir, **MODES[mode])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    _check_pools_whole(llm)
    stats = llm.speculative_stats()
    assert stats["spec_num_accepted_tokens"] > 0.9 * stats["spec_num_draft_tokens"] > 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"


def test_another_architecture_as_draft(target, tiny_model_factory):
    """A different tiny model (same tokenizer) proposes; whatever it guesses, the output is the
    target's."""
    model_dir, prompts, refs = target
    llm = _llm(model_dir, tiny_model_factory("qwen3"), max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    assert llm.speculative_stats()["spec_num_drafts"] > 0
    _check_pools_whole(llm)


def test_sampled_seeded_output_is_unchanged_by_a_draft_model(target):
    model_dir, prompts, _ = target
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
              for s in range(len(prompts))]
    llm = _llm(model_dir, model_dir)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = LLM(model=str(model_dir), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0
    _check_pools_whole(llm)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    model_dir = target[0]
    draft = shutil.copytree(model_dir, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 16
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(model_dir, draft)


def test_config_names():
    assert SpeculativeConfig(model="d").method == "draft_model"
    assert SpeculativeConfig().method == "ngram"
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="ngram", model="d")


def test_layer_skip_draft_script(target, tmp_path):
    """benchmarks/layer_skip_draft.py cuts a 1-layer draft out of the 2-layer target: it loads as a
    draft, keeps the target's greedy output exact, and proposes tokens."""
    model_dir, prompts, refs = target
    draft = tmp_path / "draft"
    benchmark_script("layer_skip_draft").write_draft(str(model_dir), 1, draft)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    llm = _llm(model_dir, draft)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    _check_pools_whole(llm)
    assert llm.speculative_stats()["spec_num_draft_tokens"] > 0
