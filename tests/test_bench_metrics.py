"""Benchmark math and arrival schedules on synthetic timestamps (hand-computed values)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from roseinfer.bench.datasets import BenchRequest, jsonl_requests, random_requests, shared_prefix_requests
from roseinfer.bench.metrics import (
    RequestTiming,
    format_p50_mean,
    format_p50_p95_p99,
    goodput,
    parse_goodput,
    percentile,
    summarize,
)
from roseinfer.bench.schedules import (
    next_submit_time,
    request_arrival_offsets,
    submit_lags,
    submit_offsets,
)

# --- percentile / summarize -------------------------------------------------------------


def test_percentile_linear_interpolation_by_hand() -> None:
    vals = [10.0, 1.0, 4.0, 2.0]  # sorted: 1 2 4 10, n-1 = 3
    assert percentile(vals, 0) == 1.0
    assert percentile(vals, 100) == 10.0
    assert percentile(vals, 50) == pytest.approx(3.0)  # rank 1.5: 2 + 0.5*(4-2)
    assert percentile(vals, 95) == pytest.approx(9.1)  # rank 2.85: 4 + 0.85*(10-4)
    assert percentile(vals, 99) == pytest.approx(9.82)  # rank 2.97: 4 + 0.97*6
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_values_and_empty() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["count"] == 5
    assert s["mean"] == 3.0 and s["median"] == 3.0 and s["p50"] == 3.0
    assert s["p95"] == pytest.approx(4.8)  # rank 3.8: 4 + 0.8
    assert s["p99"] == pytest.approx(4.96)
    assert (s["min"], s["max"]) == (1.0, 5.0)
    empty = summarize([])
    assert empty["count"] == 0
    assert all(empty[k] is None for k in ("mean", "median", "p50", "p95", "p99", "min", "max"))


# --- per-request definitions --------------------------------------------------------------


def _timing() -> RequestTiming:
    return RequestTiming(submit_start=10.0, submit_end=10.1, tokenized=10.3, admitted=10.5,
                         token_times=[11.0, 11.2, 11.5, 11.6], end=11.7)


def test_request_timing_definitions() -> None:
    t = _timing()
    assert t.ttft == pytest.approx(1.0)
    assert t.queue_wait == pytest.approx(0.2)  # admitted - max(submit_end, tokenized)
    assert t.prefill_to_first_token == pytest.approx(0.5)
    assert t.tpot == pytest.approx(0.6 / 3)
    assert t.itls == pytest.approx([0.2, 0.3, 0.1])
    assert t.latency == pytest.approx(1.7)


def test_request_timing_edge_cases() -> None:
    # tokenized earlier than submit_end: the wait starts at submit_end.
    t = RequestTiming(submit_start=0.0, submit_end=0.4, tokenized=0.1, admitted=1.0,
                      token_times=[2.0], end=2.5)
    assert t.queue_wait == pytest.approx(0.6)
    assert t.tpot is None and t.itls == []
    none = RequestTiming(submit_start=0.0, submit_end=0.1)
    assert none.ttft is None and none.queue_wait is None and none.prefill_to_first_token is None
    assert none.latency == pytest.approx(0.1)  # end falls back to submit_end
    # No tokenized stamp: queue wait is measured from submit_end.
    assert RequestTiming(0.0, 0.2, admitted=0.5).queue_wait == pytest.approx(0.3)
    # output_tokens (from a usage record) overrides the chunk count for TPOT.
    coalesced = RequestTiming(0.0, 0.0, token_times=[1.0, 2.0], end=2.0, output_tokens=5)
    assert coalesced.tpot == pytest.approx(0.25)


def test_goodput_counts_requests_meeting_all_slos() -> None:
    fast = RequestTiming(0.0, 0.0, token_times=[0.1, 0.12, 0.14], end=0.15)  # ttft 100 tpot 20
    slow_first = RequestTiming(0.0, 0.0, token_times=[0.6, 0.61], end=0.7)  # ttft 600
    slow_tail = RequestTiming(0.0, 0.0, token_times=[0.2, 1.0, 1.8], end=2.0)  # tpot 800
    one_tok = RequestTiming(1.0, 1.0, token_times=[1.1], end=1.2)  # no tpot: cannot miss it
    ts = [fast, slow_first, slow_tail, one_tok]  # duration = 2.0 - 0.0
    assert goodput(ts, {"ttft": 500}) == pytest.approx(3 / 2.0)
    assert goodput(ts, {"ttft": 500, "tpot": 50}) == pytest.approx(2 / 2.0)
    assert goodput(ts, {"e2el": 200}) == pytest.approx(2 / 2.0)
    assert goodput(ts, {"ttft": 500, "tpot": 50}, duration=4.0) == pytest.approx(0.5)
    assert goodput([], {"ttft": 1}) == 0.0
    no_token = RequestTiming(0.0, 0.0, end=1.0)
    assert goodput([no_token], {"ttft": 1e9}) == 0.0


def test_parse_goodput_and_errors() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "E2EL:2000.5"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_goodput(None) == {} and parse_goodput([]) == {}
    for bad, msg in (("ttft500", "KEY:MS"), ("itl:5", "unknown key"), ("ttft:abc", "not a number"),
                     ("ttft:-1", "positive"), ("ttft:nan", "positive")):
        with pytest.raises(ValueError, match=msg):
            parse_goodput([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_goodput(["ttft:1", "ttft:2"])


def test_format_p50_p95_p99() -> None:
    """The blog's lines: seconds in, ms out, two decimals, 0.00 for no values."""
    line = format_p50_p95_p99("TTFT", [0.001, 0.002, 0.004, 0.010])
    assert line == "TTFT p50/p95/p99: 3.00/9.10/9.82 ms"
    assert format_p50_p95_p99("TPOT", [0.5], "ms/token") == "TPOT p50/p95/p99: 500.00/500.00/500.00 ms/token"
    assert format_p50_p95_p99("ITL", []) == "ITL p50/p95/p99: 0.00/0.00/0.00 ms"


def test_format_p50_mean() -> None:
    """Median and mean over runs, as given (no unit conversion), at the blog's decimals."""
    assert format_p50_mean("Total time", [1.0, 2.0, 6.0], "s", 6) == "Total time p50/mean: 2.000000/3.000000 s"
    assert format_p50_mean("TTFT", [1.0, 2.0], "ms") == "TTFT p50/mean: 1.50/1.50 ms"


# --- schedules ----------------------------------------------------------------------------


def test_absolute_and_relative_schedules() -> None:
    assert submit_offsets(4, 0.5, "absolute") == [0.0, 0.5, 1.0, 1.5]
    assert submit_offsets(4, 0.5, "relative") is None
    offs = submit_offsets(3, 0.5, "absolute")
    assert next_submit_time(2, t0=100.0, interval_s=0.5, offsets=offs) == 101.0
    # Relative: due interval after the previous submit returned, not on a fixed grid.
    assert next_submit_time(0, t0=100.0, interval_s=0.5, offsets=None) == 100.0
    assert next_submit_time(1, t0=100.0, interval_s=0.5, offsets=None, last_submit_end=100.3) == 100.8
    assert submit_lags([100.0, 100.6, 101.25], 100.0, offs) == pytest.approx([0.0, 0.1, 0.25])
    assert submit_lags([100.0], 100.0, None) is None
    with pytest.raises(ValueError):
        submit_offsets(3, 0.5, "bogus")


def test_poisson_schedule_seeded_and_mean_gap() -> None:
    a = submit_offsets(5000, 0.02, "poisson", seed=7)
    assert a == submit_offsets(5000, 0.02, "poisson", seed=7)
    assert a != submit_offsets(5000, 0.02, "poisson", seed=8)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.02, rel=0.05)
    assert gaps.std() == pytest.approx(0.02, rel=0.1)  # exponential: std == mean


def test_gamma_arrivals_rate_burstiness_and_inf() -> None:
    assert request_arrival_offsets(5, math.inf) == [0.0] * 5
    assert request_arrival_offsets(0, 10.0) == []
    a = request_arrival_offsets(5000, 50.0, 1.0, seed=3)
    assert a == request_arrival_offsets(5000, 50.0, 1.0, seed=3)
    assert a[0] == 0.0
    gaps = {b: np.diff(request_arrival_offsets(5000, 50.0, b, seed=3)) for b in (0.25, 1.0, 4.0)}
    for g in gaps.values():
        assert g.mean() == pytest.approx(1 / 50.0, rel=0.1)  # mean gap set by rate alone
    # variance = 1/(rate^2 * burstiness): burstier (smaller b) means more spread.
    assert gaps[0.25].var() > gaps[1.0].var() > gaps[4.0].var()
    assert gaps[1.0].var() == pytest.approx(1 / 50.0**2, rel=0.15)
    for bad in ((0.0, 1.0), (-1.0, 1.0), (10.0, 0.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError):
            request_arrival_offsets(3, *bad)


# --- datasets -----------------------------------------------------------------------------


class _CharTokenizer:
    """One token per character: easy to size by hand."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_random_dataset_lengths_and_seed() -> None:
    reqs = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    assert reqs == random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    for r in reqs:
        assert 50 <= len(r.prompt.split()) == r.prompt_len <= 150
        assert 10 <= r.output_len <= 30
    assert len({r.prompt for r in reqs}) == 50
    fixed = random_requests(3, input_len=40, output_len=8, seed=2)
    assert all(len(r.prompt.split()) == 40 and r.output_len == 8 for r in fixed)
    exact = random_requests(5, input_len=37, output_len=4, seed=0, tokenizer=_CharTokenizer())
    assert all(len(r.prompt) == 37 == r.prompt_len for r in exact)


def test_shared_prefix_and_jsonl(tmp_path) -> None:
    reqs = shared_prefix_requests(4, prefix_len=64, output_len=16, seed=0)
    system = reqs[0].prompt.split("Question 0:")[0]
    assert len(system.split()) > 64 and all(r.prompt.startswith(system) for r in reqs)
    assert len({r.prompt for r in reqs}) == 4
    grouped = shared_prefix_requests(6, prefix_len=64, output_len=16, seed=0, num_prefixes=3)
    systems = [r.prompt.split("Question ")[0] for r in grouped]
    assert systems[:3] == systems[3:] and len(set(systems)) == 3 and systems[0] == system
    with pytest.raises(ValueError, match="num_prefixes"):
        shared_prefix_requests(2, prefix_len=8, output_len=4, num_prefixes=0)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5}\n\n{"prompt": "bye"}\n')
    got = jsonl_requests(path, 3, default_output_len=9)
    assert [(r.prompt, r.output_len) for r in got] == [("hello there", 5), ("bye", 9), ("hello there", 5)]
    assert isinstance(got[0], BenchRequest)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1:"):
        jsonl_requests(path, None, 9)
