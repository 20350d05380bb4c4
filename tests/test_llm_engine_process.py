"""LLM(engine_process="on"): the offline API over the engine process gives what it gives in the
calling thread (tokens, text, stop strings, logprobs, embeddings), refuses bad input before anything
is sent, frees every block, and its shutdown leaves no process."""
from __future__ import annotations

from pathlib import Path

import pytest

from roseinfer.llm import LLM
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from server_helpers import wait_for
from test_engine_process import alive
from tiny_models import hf_greedy, sample_prompts


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llms(model_dir: Path):
    here = LLM(model=str(model_dir), num_kv_blocks=128)
    apart = LLM(model=str(model_dir), num_kv_blocks=128, engine_process="on")
    yield here, apart
    here.shutdown()
    apart.shutdown()


def test_generate_gives_what_the_calling_thread_gives(llms, model_dir: Path) -> None:
    here, apart = llms
    prompts = sample_prompts(model_dir, 5, seed=7, max_len=30)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ours = apart.generate(prompts + ["The cat sees"], greedy, use_tqdm=False)
    theirs = here.generate(prompts + ["The cat sees"], greedy, use_tqdm=False)
    for ids, out in zip(prompts, ours):
        assert out.token_ids == hf_greedy(model_dir, ids, 12)
    assert [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in ours] == \
           [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in theirs]
    assert wait_for(lambda: apart.kv_cache_stats()["used_blocks"] == 0)


def test_a_stop_string_and_an_embedding_cross_the_boundary(llms) -> None:
    here, apart = llms
    text = here.generate(["The cat sees"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[text[3:6]])
    ours, theirs = (llm.generate(["The cat sees"], stop, use_tqdm=False)[0] for llm in (apart, here))
    assert (ours.text, ours.finish_reason, ours.stop_reason) == (theirs.text, "stop", text[3:6])
    assert apart.embed(["The cat sees"], use_tqdm=False)[0].outputs.embedding == \
           here.embed(["The cat sees"], use_tqdm=False)[0].outputs.embedding
    assert wait_for(lambda: apart.kv_cache_stats()["used_blocks"] == 0)


def test_a_constraint_that_fails_while_generating_says_why(llms) -> None:
    """The core ends the request early; the output carries its reason, as the server's 400 does, and
    the request beside it is untouched."""
    failing = SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="[b-z]{20}a{1000000}"))
    fine = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for llm in llms:
        failed, other = llm.generate(["hello", "The cat sees"], [failing, fine], use_tqdm=False)
        assert failed.finish_reason == "abort" and "failed while generating" in (failed.error or "")
        assert other.error is None and len(other.token_ids) == 6
        assert wait_for(lambda: llm.kv_cache_stats()["used_blocks"] == 0)


def test_bad_input_is_refused_before_anything_is_sent(llms) -> None:
    _, apart = llms
    assert wait_for(lambda: apart._client.stats()["num_inflight"] == 0)
    with pytest.raises(ValueError, match="max_tokens"):
        apart.generate(["fine", "also fine"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=0)],
                       use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        apart.embed(["fine"], PoolingParams(dimensions=3), use_tqdm=False)
    assert apart._client.stats()["num_inflight"] == 0  # the first prompt was never submitted


def test_shutdown_leaves_no_process(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), num_kv_blocks=64, engine_process="on")
    process = llm._client.process
    assert llm.generate("The cat", SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
    llm.shutdown()
    assert not alive(process.pid)


def test_reset_prefix_cache_reaches_the_engine_process(llms, model_dir: Path) -> None:
    _, apart = llms
    prompt = sample_prompts(model_dir, 1, seed=11, max_len=40)[0] * 2  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    apart.generate([prompt], params, use_tqdm=False)
    assert apart.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
    apart.reset_prefix_cache()
    assert apart.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
