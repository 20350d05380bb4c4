"""Benchmark math: pure functions on per-request timestamps.

Every timestamp is a float in seconds from one monotonic clock (``time.perf_counter``);
only differences are ever taken, so the clock's origin does not matter. SLOs given on
the command line are in milliseconds (the unit people quote them in) and are converted
here, at the one place they are compared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Keys accepted by --goodput; the names match vLLM's benchmark_serving so that
# command lines carry over unchanged.
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")

# Keys of a summarize() result, in the order tables print them.
SUMMARY_KEYS: tuple[str, ...] = ("mean", "median", "p50", "p95", "p99", "min", "max")


def percentile(values: Sequence[float] | Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) with linear interpolation.

    This is numpy's default ("linear") method: rank = q/100 * (n - 1), interpolated
    between the two neighbouring sorted values. Raises ValueError on empty input,
    because there is no honest number to return.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(arr, q))


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, median, p50, p95, p99, min, max of ``values``.

    Empty input gives count 0 and None for every statistic (rather than 0.0, which
    would read as "instant" in a latency table).
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, **{k: None for k in SUMMARY_KEYS}}
    p50, p95, p99 = (float(x) for x in np.percentile(arr, [50.0, 95.0, 99.0]))
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "median": p50,
        "p50": p50,
        "p95": p95,
        "p99": p99,
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


@dataclass
class RequestTiming:
    """Timestamps of one request's life (seconds, one monotonic clock).

    submit_start / submit_end bracket the client's submit call; ``tokenized`` and
    ``admitted`` are engine-side events (None when the client cannot see them, e.g.
    over HTTP); ``token_times`` holds the arrival time of each generated token (or of
    each streamed chunk carrying text); ``end`` is when the request finished.
    ``output_tokens`` optionally overrides the token count used for TPOT, for servers
    that coalesce several tokens into one streamed chunk (the count then comes from
    the usage record, the span still from the first and last chunk).
    """

    submit_start: float
    submit_end: float
    tokenized: float | None = None
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    # None means "use the last token time" (or submit_end when there are no tokens),
    # so that engine-side callers that only record tokens need not fill it in.
    end: float | None = None
    output_tokens: int | None = None
    num_preemptions: int = 0  # times the engine took its KV blocks back and recomputed it

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finish(self) -> float:
        """``end`` with the documented fallbacks applied."""
        if self.end is not None:
            return self.end
        if self.token_times:
            return self.token_times[-1]
        return self.submit_end

    @property
    def num_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        first = self.first_token
        return None if first is None else first - self.submit_start

    @property
    def queue_wait(self) -> float | None:
        """Time spent queued: from when the request was ready (submitted and, if known,
        tokenized) until the scheduler admitted it."""
        if self.admitted is None:
            return None
        ready = self.submit_end if self.tokenized is None else max(self.submit_end, self.tokenized)
        return self.admitted - ready

    @property
    def prefill_to_first_token(self) -> float | None:
        first = self.first_token
        if first is None or self.admitted is None:
            return None
        return first - self.admitted

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        n = self.num_tokens
        if n < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token (chunk) arrivals."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float:
        return self.finish - self.submit_start


def benchmark_duration(timings: Sequence[RequestTiming]) -> float:
    """From the first submission to the last completion; 0.0 for no requests."""
    if not timings:
        return 0.0
    return max(t.finish for t in timings) - min(t.submit_start for t in timings)


def meets_slo(timing: RequestTiming, slo: dict[str, float]) -> bool:
    """Whether one request meets every SLO given (ms). A request with no token misses a
    TTFT SLO; one with a single token has no TPOT and so cannot miss a TPOT SLO."""
    for key, limit_ms in slo.items():
        if key == "ttft":
            value = timing.ttft
            if value is None:
                return False
        elif key == "tpot":
            value = timing.tpot
            if value is None:
                continue
        elif key == "e2el":
            value = timing.latency
        else:
            raise ValueError(f"unknown SLO key {key!r}; expected one of {', '.join(SLO_KEYS)}")
        if value * 1000.0 > limit_ms:
            return False
    return True


def goodput(
    timings: Sequence[RequestTiming], slo: dict[str, float], duration: float | None = None
) -> float:
    """Requests per second that met all SLOs in ``slo`` (ms per key: ttft, tpot, e2el).

    ``duration`` defaults to the span of ``timings``; a caller that measured the
    benchmark's wall time itself (including failed requests) should pass it.
    """
    if duration is None:
        duration = benchmark_duration(timings)
    if duration <= 0.0:
        return 0.0
    good = sum(1 for t in timings if meets_slo(t, slo))
    return good / duration


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slo: dict[str, float] = {}
    for item in items or []:
        key, sep, raw = item.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"invalid goodput SLO {item!r}: expected KEY:MS, e.g. ttft:500")
        if key not in SLO_KEYS:
            raise ValueError(
                f"invalid goodput SLO {item!r}: unknown key {key!r}; expected one of "
                f"{', '.join(SLO_KEYS)}"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"invalid goodput SLO {item!r}: {raw!r} is not a number of ms") from None
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"invalid goodput SLO {item!r}: the limit must be a positive number of ms")
        if key in slo:
            raise ValueError(f"invalid goodput SLO {item!r}: {key} given twice")
        slo[key] = value
    return slo


def percentiles_ms(values_seconds: Iterable[float], qs: Sequence[float] = (50.0, 95.0, 99.0)) -> list[float]:
    """Percentiles of ``values_seconds`` in ms, 0.0 each when there are none: the blog prints
    ``0.00/0.00/0.00`` e.g. for TPOT when every request made a single token."""
    arr = np.asarray(list(values_seconds), dtype=np.float64)
    if arr.size == 0:
        return [0.0] * len(qs)
    return [float(x) * 1000.0 for x in np.percentile(arr, list(qs))]


def format_p50_p95_p99(name: str, values_seconds: Iterable[float], unit: str = "ms") -> str:
    """The blog's line, e.g. ``TTFT p50/p95/p99: 7.60/18.62/24.86 ms`` (input in seconds)."""
    p50, p95, p99 = percentiles_ms(values_seconds)
    return f"{name} p50/p95/p99: {p50:.2f}/{p95:.2f}/{p99:.2f} {unit}"


def format_p50_mean(name: str, values: Sequence[float], unit: str, decimals: int = 2) -> str:
    """The blog's line over repeat runs, e.g. ``Total time p50/mean: 7.817085/7.813045 s`` (values
    as printed: no unit conversion)."""
    p50, mean = float(np.median(values)), float(np.mean(values))
    return f"{name} p50/mean: {p50:.{decimals}f}/{mean:.{decimals}f} {unit}"
