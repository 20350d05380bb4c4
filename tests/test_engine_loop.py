"""InProcessClient (the engine core stepped in a thread) and the stop-string matcher, driven directly
(no HTTP)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.sampling_params import SamplingParams
from roseinfer.engine_client.client import SHUTDOWN_MESSAGE, OverloadedError, ShuttingDownError
from roseinfer.engine_client.in_process import InProcessClient
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.output_processor import StreamDelta
from roseinfer.stop_strings import StopStringMatcher
from server_helpers import wait_for
from step_gate import StepGate

PROMPT = "The cat sees a red apple"


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_factory("llama"))))


@pytest.fixture
def manager(engine: LLMEngine):
    created: list[InProcessClient] = []

    def make(**kwargs) -> InProcessClient:
        m = InProcessClient(engine, **kwargs)
        m.start()
        created.append(m)
        return m

    yield make
    for m in created:
        m.shutdown()
    assert not engine.has_unfinished(), "a manager left work in the engine"


@pytest.fixture
def gate(engine: LLMEngine, manager, monkeypatch: pytest.MonkeyPatch):
    """The engine's steps held until the test lets them through (opened again at the end, before
    the managers shut down)."""
    held = StepGate(engine, monkeypatch)
    yield held
    held.allow()


def drain(stream: RequestStream) -> list[StreamDelta]:
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(stream.get(timeout=30))
    return deltas


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_stream_interval_first_token_at_once_then_every_n_and_the_rest_at_the_end(engine, manager) -> None:
    m = manager(stream_interval=4)
    deltas = drain(m.submit(engine.tokenizer.encode(PROMPT), greedy(10)))
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 1]
    assert [d.num_output_tokens for d in deltas] == [1, 5, 9, 10]
    assert [d.finished for d in deltas] == [False, False, False, True]
    assert deltas[-1].finish_reason == "length"
    assert all(d.num_prompt_tokens == len(engine.tokenizer.encode(PROMPT)) for d in deltas)
    stamps = [d.timestamp for d in deltas]
    assert stamps == sorted(stamps)


def test_streamed_text_equals_the_full_decode(engine, manager) -> None:
    m = manager(stream_interval=3)
    prompts = [engine.tokenizer.encode(f"{PROMPT} {i}") for i in range(12)]
    streams = [m.submit(ids, greedy(40)) for ids in prompts]
    for stream in streams:
        deltas = drain(stream)
        ids = [t for d in deltas for t in d.token_ids]
        assert len(ids) == 40
        assert "".join(d.text for d in deltas) == engine.tokenizer.decode(ids)
        timings = stream.timings
        order = ["submit_start", "submit_end", "admitted", "first_token", "finished"]
        assert [timings[k] for k in order] == sorted(timings[k] for k in order)


def _a_stop_string(engine: LLMEngine, m: InProcessClient) -> tuple[list[int], str, str]:
    """PROMPT's ids, its 60-token greedy text, and a stop string that starts a third of the way in and
    spans several tokens' worth of that text."""
    ids = engine.tokenizer.encode(PROMPT)
    full = "".join(d.text for d in drain(m.submit(ids, greedy(60))))
    start = len(full) // 3
    return ids, full, full[start:start + 6]


def test_stop_string_across_chunks_is_cut_with_everything_after_it(engine, manager) -> None:
    m = manager()
    ids, full, stop = _a_stop_string(engine, m)
    expected = full[:full.index(stop)]
    deltas = drain(m.submit(ids, greedy(60, stop=[stop, "never-appears-xyz"])))
    streamed = "".join(d.text for d in deltas)
    assert streamed == expected
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].num_output_tokens < 60  # aborted in the engine once the stop text appeared
    # nothing that was sent may end in a prefix of the stop string and then be taken back
    sent = ""
    for d in deltas:
        sent += d.text
        assert expected.startswith(sent)
    assert wait_for(lambda: m.stats()["kv_cache_usage_ratio"] == 0.0)


def test_include_stop_str_in_output_streams_through_the_stop_and_no_further(engine, manager) -> None:
    m = manager()
    ids, full, stop = _a_stop_string(engine, m)
    expected = full[:full.index(stop) + len(stop)]
    deltas = drain(m.submit(ids, greedy(60, stop=[stop], include_stop_str_in_output=True)))
    assert "".join(d.text for d in deltas) == expected
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert deltas[-1].num_output_tokens < 60


def test_stop_matcher_holds_back_only_what_could_start_a_stop() -> None:
    matcher = StopStringMatcher(["world", "wx"])
    assert matcher.add("hello w") == ("hello ", False)  # "w" may begin either stop string
    assert matcher.add("o") == ("", False)  # "wo" may still become "world"
    assert matcher.add("ndrous") == ("wondrous", False)  # it did not
    assert matcher.add(" wor") == (" ", False)
    assert matcher.add("ld and more") == ("", True)
    late = StopStringMatcher(["</s>"])
    assert late.add("a</") == ("a", False)
    assert late.flush() == "</"  # the request ended without a match: held text is ordinary text
    first = StopStringMatcher(["bb", "ab"])
    assert first.add("xabb") == ("x", True)  # the earliest match wins, whichever string it is
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_abort_frees_blocks_at_once(engine, manager, gate) -> None:
    m = manager()
    gate.allow(1)
    stream = m.submit(engine.tokenizer.encode(PROMPT), greedy(200))
    first = stream.get(timeout=30)
    assert not first.finished
    assert m.stats()["kv_cache_usage_ratio"] > 0
    m.abort(stream.request_id)  # taken after the step held at the gate
    gate.allow()
    rest = drain(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].num_output_tokens == 2
    stats = m.stats()
    assert stats["kv_cache_usage_ratio"] == 0.0 and stats["num_running"] == 0
    assert wait_for(lambda: m.stats()["num_inflight"] == 0)


def test_overload_and_bad_input_fail_in_the_callers_thread(engine, manager, gate) -> None:
    m = manager(max_inflight_requests=2)
    ids = engine.tokenizer.encode(PROMPT)
    held = [m.submit(ids, greedy(200)) for _ in range(2)]  # held at the gate: in flight until aborted
    with pytest.raises(OverloadedError):
        m.submit(ids, greedy(4))
    with pytest.raises(ValueError, match="empty"):
        m.submit([], greedy(4))
    with pytest.raises(ValueError, match="context length"):
        m.submit(ids, greedy(engine.max_model_len))
    with pytest.raises(ValueError, match="already in flight"):
        m.submit(ids, greedy(4), request_id=held[0].request_id)
    for stream in held:
        m.abort(stream.request_id)
    gate.allow()
    for stream in held:
        assert drain(stream)[-1].finish_reason == "abort"
    assert wait_for(lambda: m.stats()["num_inflight"] == 0)
    assert drain(m.submit(ids, greedy(4)))[-1].finish_reason == "length"


def test_async_consumer_and_shutdown_aborts_what_is_in_flight(engine, gate) -> None:
    m = InProcessClient(engine)
    m.start()
    ids = engine.tokenizer.encode(PROMPT)
    gate.allow(3)  # the request gets 3 of its 200 tokens, then waits for the shutdown

    async def run() -> list[StreamDelta]:
        stream = m.submit(ids, greedy(200))  # on the loop: read with async for
        with pytest.raises(RuntimeError):
            stream.get(timeout=1)
        deltas = []
        async for delta in stream:
            deltas.append(delta)
            if len(deltas) == 3:
                # the fourth step has begun (it waits at the gate); shutdown blocks while the worker
                # finishes it, so it runs off the loop that must receive the final delta
                assert await asyncio.to_thread(gate.wait_until_held)
                stopped = asyncio.get_running_loop().run_in_executor(None, m.shutdown)
                assert await asyncio.to_thread(wait_for, lambda: not m.is_alive)
                gate.allow()
                await stopped
        return deltas

    deltas = asyncio.run(run())
    # a request cut by shutdown ends with an error its client can see (HTTP 503), never silently
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert (deltas[-1].error, deltas[-1].error_status) == (SHUTDOWN_MESSAGE, 503)
    assert deltas[-1].num_output_tokens == 4  # the step held at the gate, then nothing more
    assert not m.is_alive and not engine.has_unfinished()
    assert engine.kv_cache_stats()["used_blocks"] == 0
    with pytest.raises(ShuttingDownError):
        m.submit(ids, greedy(4))


def test_drain_refuses_new_requests_lets_short_ones_finish_and_ends_the_rest_at_the_deadline(
        engine, gate, monkeypatch: pytest.MonkeyPatch) -> None:
    m = InProcessClient(engine)
    m.start()
    ids = engine.tokenizer.encode(PROMPT)
    # The deadline's timer passes only once the short request has ended, and the long one takes
    # one step past it: the grace period outlasts the one and not the other by construction.
    short_done, deadline_passed = threading.Event(), threading.Event()
    pass_deadline = m._pass_deadline

    def pass_deadline_after_the_short_request() -> None:
        assert short_done.wait(60)
        pass_deadline()
        deadline_passed.set()

    monkeypatch.setattr(m, "_pass_deadline", pass_deadline_after_the_short_request)
    try:
        short = m.submit(ids, greedy(3))
        long = m.submit(ids, greedy(240))
        gate.allow(2)  # short has 2 of its 3 tokens after two steps, whether or not they started together
        delta = short.get(timeout=30)
        while delta.num_output_tokens < 2:
            delta = short.get(timeout=30)
        assert not delta.finished and long.get(timeout=30).token_ids  # both are running
        m.drain(timeout=0)
        with pytest.raises(ShuttingDownError):
            m.submit(ids, greedy(3))
        gate.allow(1)  # short's last step
        assert drain(short)[-1].finish_reason == "length"  # finished within the grace period
        short_done.set()
        assert deadline_passed.wait(60)
        gate.allow()
        last = drain(long)[-1]
        assert (last.finish_reason, last.error, last.error_status) == ("abort", SHUTDOWN_MESSAGE, 503)
        assert last.num_output_tokens < 240 and m.is_alive is False
        assert wait_for(lambda: engine.kv_cache_stats()["used_blocks"] == 0)
    finally:
        m.shutdown()
