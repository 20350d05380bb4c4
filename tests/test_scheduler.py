"""The request lifecycle API, chunked prefill under a budget, abort, and the admission knobs."""
from __future__ import annotations

import pytest

from roseinfer import SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def _engine(model_dir: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, **{"num_kv_blocks": 64, **kw}))


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_lifecycle_api(model_dir):
    engine = _engine(model_dir)
    rid = engine.add_request(list(range(5, 25)), GREEDY, request_id="x")
    assert rid == "x" and not engine.is_finished("x") and engine.has_unfinished()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], GREEDY, request_id="x")
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["x"] and len(outputs[0].new_token_ids) == 1
    ids = engine.get_generated_ids("x")
    ids.append(-1)  # a copy: changing it must not touch the request
    assert engine.get_generated_ids("x") == ids[:-1]
    _run(engine)
    assert engine.is_finished("x") and engine.get_step_count("x") == 8
    req = engine.get_request("x")
    assert req.arrival_time <= req.admitted_time <= req.first_token_time <= req.finished_time
    assert len(req.token_times) == 8 and req.token_times == sorted(req.token_times)
    assert engine.pop_finished_ids() == ["x"] and engine.pop_finished_ids() == []
    with pytest.raises(KeyError):
        engine.get_request("x")
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_chunked_prefill_respects_the_token_budget(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=8)
    engine.add_request(list(range(5, 45)), GREEDY)  # 40 prompt tokens -> 5 chunks of 8
    engine.add_request(list(range(50, 53)), GREEDY)
    for _ in range(5):
        out = engine.scheduler.schedule()
        assert out.num_tokens <= 8
        engine.scheduler.update(out, *engine.runner.execute(out))
    assert engine.get_request("req-0").num_computed_tokens == 40
    _run(engine)
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_decodes_are_not_starved_by_a_burst_of_long_prompts(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=16, num_kv_blocks=128)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), request_id="d")
    engine.step()
    for i in range(4):
        engine.add_request(list(range(10, 110)), GREEDY, request_id=f"long{i}")
    for _ in range(10):
        assert "d" in [o.request_id for o in engine.step()]
    _run(engine)


@pytest.mark.parametrize("where", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_everything(model_dir, where):
    engine = _engine(model_dir, max_num_batched_tokens=16)
    keep = engine.add_request([5, 6, 7], GREEDY)
    victim = engine.add_request(list(range(5, 70)), GREEDY)
    if where != "waiting":
        engine.step()  # victim computes its first 13-token chunk
        assert engine.get_request(victim).in_prefill
    if where == "mid_decode":
        while engine.get_request(victim).in_prefill:
            engine.step()
        engine.step()
        assert engine.get_request(victim).num_output_tokens >= 1
    assert engine.abort_request(victim)
    assert not engine.abort_request(victim)  # a second abort is a no-op
    assert engine.get_request(victim).finish_reason == "abort"
    _run(engine)
    assert set(engine.pop_finished_ids()) == {keep, victim}
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_admission_knobs_bound_each_step(model_dir):
    engine = _engine(model_dir, prefill_max_batch_size=2, prefill_max_tokens=30, max_active_requests=3)
    for i in range(6):
        engine.add_request(list(range(5, 15 + i)), GREEDY)
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == 2 and out.num_tokens <= 30
    engine.scheduler.update(out, *engine.runner.execute(out))
    for _ in range(3):
        out = engine.scheduler.schedule()
        engine.scheduler.update(out, *engine.runner.execute(out))
        assert len(engine.scheduler.running) <= 3
    _run(engine)
    assert engine.kv_cache_stats()["used_blocks"] == 0


def test_pack_policy_admits_the_cheapest_prompts_first(model_dir):
    engine = _engine(model_dir, prefill_admission_policy="pack", prefill_max_batch_size=2)
    long_id = engine.add_request(list(range(5, 105)), GREEDY)
    short = [engine.add_request([5, 6, 7 + i], GREEDY) for i in range(2)]
    out = engine.scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == short
    engine.scheduler.update(out, *engine.runner.execute(out))
    _run(engine)
    assert engine.get_request(long_id).is_finished


def test_decode_first_alternates_decode_and_prefill_steps(model_dir):
    engine = _engine(model_dir, decode_first=True)
    engine.add_request([5, 6, 7], GREEDY)
    engine.step()
    engine.add_request(list(range(5, 30)), GREEDY)
    kinds = []
    for _ in range(2):
        out = engine.scheduler.schedule()
        kinds.append({s.request.in_prefill for s in out.scheduled})
        engine.scheduler.update(out, *engine.runner.execute(out))
    assert {False} in kinds and {True} in kinds
    _run(engine)
