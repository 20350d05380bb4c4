"""Tensor parallelism over two ranks (gloo on CPU): greedy output equals HF's token for token for
every architecture (MQA's one KV head replicated on both ranks) under chunked prefill, prefix
caching and preemption, prompt logprobs and speculative decoding on rank 0 included; shutdown
leaves no process and no group thread; a killed rank fails the engine at its next step and leaves no
process; a size that does not divide the model is refused.

Each engine start spawns a worker (~1-3 s): one engine per architecture serves all of its cases."""
from __future__ import annotations

import gc
import os
import signal
import threading

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.executor.rank_processes import WorkerError
from server_helpers import wait_for
from test_correctness import GREEDY, MAX_TOKENS, _prompts
from test_prompt_logprobs import assert_matches_hf
from tiny_models import hf_greedy, sample_prompts

# chunked prefill (16-token steps, prompts up to 100), a pool small enough to preempt, prefix caching on
OPTIONS = {"tensor_parallel_size": 2, "num_kv_blocks": 10, "max_num_batched_tokens": 16}


def _gone(pid: int) -> bool:
    """The process has exited and been reaped (or is a zombie about to be)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _gloo_threads() -> int:
    """This process's threads that run a gloo group's collectives."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended after the listing
            continue
    return names.count("pt_gloo_runloop")


@pytest.fixture(scope="module")
def tp_llm(tiny_model_dir):
    gc.collect()  # an earlier test's unreferenced engine leaves its group now, not halfway through this count
    before = _gloo_threads()
    llm = LLM(model=str(tiny_model_dir), **OPTIONS)
    pids = llm.engine.executor.ranks.pids
    assert _gloo_threads() > before
    yield llm
    llm.shutdown()
    assert all(_gone(pid) for pid in pids)
    # rank 0 left its group at shutdown, not at interpreter exit, where its threads can abort the process
    assert _gloo_threads() == before


def test_greedy_matches_hf_on_two_ranks(tp_llm, tiny_model_dir):
    prompts = _prompts(tiny_model_dir)
    refs = [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in prompts]
    # two calls, so the second's shared prefixes and exact repeat find the first's cached blocks
    outs = tp_llm.generate(prompts[:6], GREEDY, use_tqdm=False) + tp_llm.generate(prompts[6:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    stats = tp_llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    assert stats["prefix_cache_hits"] > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"
    assert max(len(p) for p in prompts) > OPTIONS["max_num_batched_tokens"]  # prompts were chunked
    # each rank holds its share: half the query heads, and half the KV heads (MQA's one on both)
    cfg, runner = tp_llm.engine.model_config, tp_llm.engine.runner
    assert runner.kv_caches[0][0].shape[1] == max(1, cfg.num_kv_heads // 2)


def test_prompt_and_sampled_logprobs_on_two_ranks(tp_llm, tiny_model_dir):
    """The logits of prompt positions (in LOGITS_CHUNK_ROWS pieces) and of sampled rows are gathered
    to rank 0 from both ranks' halves of the vocabulary."""
    prompts = sample_prompts(tiny_model_dir, 2, seed=21, max_len=70)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    for prompt, out in zip(prompts, tp_llm.generate(prompts, params, use_tqdm=False)):
        assert_matches_hf(tiny_model_dir, prompt, out.prompt_logprobs)
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 4)
        assert len(out.logprobs) == 4 and all(len(lp.top) == 2 for lp in out.logprobs)
    assert tp_llm.kv_cache_stats()["used_blocks"] == 0


def test_draft_model_speculation_on_two_ranks(tiny_model_factory):
    """The draft model runs whole on rank 0; the target's verification rows are sampled there from
    logits gathered from both ranks."""
    model_dir, draft_dir = tiny_model_factory("qwen2"), tiny_model_factory("llama")
    prompts = [p[:4] * 6 for p in sample_prompts(model_dir, 3, seed=4)]
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    llm = LLM(model=str(model_dir), speculative_config=spec, **OPTIONS)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
        assert llm.speculative_stats()["spec_num_drafts"] > 0
        assert llm.kv_cache_stats()["used_blocks"] == 0
    finally:
        llm.shutdown()


def test_a_killed_rank_fails_the_engine_at_its_next_step_and_leaves_no_process(tiny_model_factory, monkeypatch):
    llm = LLM(model=str(tiny_model_factory("llama")), tensor_parallel_size=2, num_kv_blocks=64)
    [pid] = llm.engine.executor.ranks.pids
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    real_step, steps = llm.engine.step, []

    def step() -> list:
        steps.append("started")
        out = real_step()
        if len(steps) == 3:  # rank 1 dies between two steps, mid-generation
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: _gone(pid))
        return out

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        llm.generate([[5, 6, 7]] * 4, long, use_tqdm=False)
    assert len(steps) == 4  # the first step after the kill failed: no wait for a timeout
    assert _gone(pid)
    with pytest.raises(WorkerError):  # and it stays failed
        llm.generate([[5, 6, 7]], long, use_tqdm=False)


def test_a_size_that_does_not_divide_the_model_is_refused_before_any_worker_starts(tiny_model_factory):
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="4 attention heads are not divisible by 3.*Sizes that do: 1, 2, 4"):
        LLM(model=str(tiny_model_factory("llama")), tensor_parallel_size=3)
    assert multiprocessing.active_children() == before
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(model=str(tiny_model_factory("llama")), tensor_parallel_size=0)


def test_every_engine_command_takes_the_flag():
    from roseinfer.cli import build_parser

    for argv in (["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "offline"], ["bench", "streaming"]):
        assert build_parser().parse_args(argv + ["--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_a_vocabulary_that_does_not_divide_is_padded_on_the_last_rank():
    """5 rows over 2 ranks: 3 each, the last rank's third row zeros; lookups and logits come out
    whole (two ranks as threads of this process, on a gloo group)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    from roseinfer.distributed.parallel import TensorParallel, vocab_parallel_embedding
    from roseinfer.models.weights import WeightLoader

    table = torch.arange(20, dtype=torch.float32).view(5, 4)
    hidden = torch.randn(3, 4)
    store, results = dist.HashStore(), {}

    def rank(r: int) -> None:
        tp = TensorParallel(r, 2, dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)))
        model = nn.Module()
        model.embed = vocab_parallel_embedding(5, 4, tp)
        WeightLoader(model, {}).load("embed.weight", table)
        ids = torch.tensor([4, 0, 2, 3])
        results[r] = (model.embed.weight.detach().clone(), tp.embed(model.embed, ids),
                      tp.gather_logits(hidden @ model.embed.weight.T, 5))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (shard0, emb0, logits0), (shard1, emb1, logits1) = results[0], results[1]
    assert torch.equal(shard0, table[:3]) and torch.equal(shard1, torch.cat([table[3:], torch.zeros(1, 4)]))
    assert torch.equal(emb0, table[[4, 0, 2, 3]]) and torch.equal(emb1, emb0)
    assert logits1 is None and logits0.is_contiguous() and torch.allclose(logits0, hidden @ table.T)
