"""Phi-3's LongRoPE through the engine and the server: a sequence that outgrows the original context
switches to the long factors, its cache recomputed once, as transformers generates; the OpenAI client
gets HF's greedy tokens across the switch."""
from __future__ import annotations

import pathlib

import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import Scheduler
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.app import build_app
from server_helpers import openai_client, serve_app
from tiny_models import hf_greedy

MODEL = "tiny-phi3"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
MAX_TOKENS = 40
ORIGINAL = 48  # the tiny checkpoint's original_max_position_embeddings (tests/tiny_models.py)


@pytest.fixture(scope="module")
def phi3_dir(tiny_model_factory) -> pathlib.Path:
    return tiny_model_factory("phi3_longrope")


def test_chat_through_the_openai_client_is_hf_greedy_across_the_switch(phi3_dir: pathlib.Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(phi3_dir)))
    prompt_ids = engine.tokenizer.apply_chat_template(MESSAGES, True)
    assert len(prompt_ids) <= ORIGINAL < len(prompt_ids) + MAX_TOKENS  # short factors first, then long
    expected = engine.tokenizer.decode(hf_greedy(phi3_dir, prompt_ids, MAX_TOKENS))
    with serve_app(build_app(engine, MODEL)) as url:
        client = openai_client(url)
        kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == MAX_TOKENS
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
        assert streamed == expected
    assert engine.block_manager.num_used_blocks == 0


def _scheduler(enable_prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", num_kv_blocks=32, block_size=4, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, BlockManager(32, 4, enable_prefix_caching), max_model_len=64, eos_token_ids=set())


def test_a_sequence_outgrowing_the_original_context_is_recomputed_once_not_preempted() -> None:
    scheduler = _scheduler()
    req = Request("a", list(range(10, 17)), SamplingParams(max_tokens=8), long_rope_from=8)
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert [s.num_tokens for s in out.scheduled] == [7] and not req.kv_rotated_long
    scheduler.update(out, [[30]], [None])  # 8 tokens: still short
    out = scheduler.schedule()
    assert [s.num_tokens for s in out.scheduled] == [1] and not req.kv_rotated_long
    scheduler.update(out, [[31]], [None])  # 9 > 8: its 8 cached short K/V are computed again, long
    out = scheduler.schedule()
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(req, 9)] and req.kv_rotated_long
    assert req.num_preemptions == 0 and scheduler.num_preemptions == 0 and not out.preempted_ids
    scheduler.update(out, [[32]], [None])
    assert [s.num_tokens for s in scheduler.schedule().scheduled] == [1]  # and once only


def test_long_and_short_rotations_of_the_same_tokens_never_share_cached_blocks() -> None:
    scheduler = _scheduler()
    manager = scheduler.block_manager
    tokens = list(range(10, 30))
    short = Request("short", tokens[:8], SamplingParams(max_tokens=1), long_rope_from=12)
    manager.allocate_cached_prefix(short)
    manager.append_slots(short, 8)
    short.num_computed_tokens = 8
    manager.cache_full_blocks(short)
    long = Request("long", tokens, SamplingParams(max_tokens=1), long_rope_from=12)
    assert manager.allocate_cached_prefix(long) == 0 and long.kv_rotated_long
    again = Request("again", tokens[:9], SamplingParams(max_tokens=1), long_rope_from=12)
    assert manager.allocate_cached_prefix(again) == 8  # the same rotation does share


def test_drafts_stop_short_of_the_switch() -> None:
    req = Request("a", list(range(10)), SamplingParams(), long_rope_from=12)
    assert [req.draft_room(n) for n in (0, 1, 2, 5)] == [0, 1, 2, 2]
    req.token_ids += [1, 2, 3]  # 13 > 12: long already, drafts run free
    assert req.draft_room(5) == 5
    assert Request("b", list(range(10)), SamplingParams()).draft_room(5) == 5  # no LongRoPE
