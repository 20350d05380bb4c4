"""Arrival schedules: when each benchmark request is submitted.

Two families live here:

* ``submit_offsets`` for the in-process engine benchmark, with three schedules:
  - ``absolute``: request i is due at t0 + i * interval (an open-loop, fixed-rate load;
    a slow submit does not push later requests back).
  - ``poisson``: like absolute, but the gaps are exponential with mean ``interval``
    (a memoryless arrival process; seeded, so runs are reproducible).
  - ``relative``: no fixed timeline. The caller sleeps ``interval`` after each submit
    call *returns*, so a slow submit delays everything after it (closed-loop-ish).
    ``submit_offsets`` returns None for it; use ``next_submit_time`` to get the due
    time of the next request from the previous submit's end.
* ``request_arrival_offsets`` for ``bench serve``: vLLM's gamma arrival process,
  parameterised by a request rate and a burstiness factor.

All offsets are seconds relative to the benchmark's start t0; the first request is
always due at offset 0 so that n requests span n - 1 gaps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

Schedule = Literal["relative", "absolute", "poisson"]
SCHEDULES: tuple[str, ...] = ("relative", "absolute", "poisson")


def _cumulative(gaps: np.ndarray) -> list[float]:
    # Offsets start at 0: the first request is due immediately, later ones after the
    # running sum of the gaps before them.
    return [0.0, *np.cumsum(gaps).tolist()]


def submit_offsets(
    n: int, interval_s: float, schedule: Schedule | str = "absolute", seed: int = 0
) -> list[float] | None:
    """Due times (seconds after t0) of ``n`` submissions, or None for ``relative``.

    ``relative`` has no fixed timeline because each due time depends on when the
    previous submit finished; see ``next_submit_time``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if interval_s < 0 or not math.isfinite(interval_s):
        raise ValueError(f"interval_s must be a finite number >= 0, got {interval_s}")
    if schedule == "relative":
        return None
    if n == 0:
        return []
    if schedule == "absolute":
        return [i * interval_s for i in range(n)]
    if schedule == "poisson":
        if interval_s == 0:
            return [0.0] * n
        rng = np.random.default_rng(seed)
        return _cumulative(rng.exponential(scale=interval_s, size=n - 1))
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def next_submit_time(
    index: int,
    t0: float,
    interval_s: float,
    offsets: Sequence[float] | None,
    last_submit_end: float | None = None,
) -> float:
    """Absolute clock time at which request ``index`` is due.

    With fixed ``offsets`` (absolute / poisson) it is ``t0 + offsets[index]``. With
    ``offsets is None`` (relative) the first request is due at t0 and each later one
    ``interval_s`` after the previous submit call returned (``last_submit_end``).
    """
    if offsets is not None:
        return t0 + offsets[index]
    if index == 0 or last_submit_end is None:
        return t0
    return last_submit_end + interval_s


def submit_lags(
    actual_times: Sequence[float], t0: float, offsets: Sequence[float] | None
) -> list[float] | None:
    """Per request: actual submit time - target time. Positive means the load generator
    fell behind its schedule. Only meaningful for fixed timelines, so None for relative."""
    if offsets is None:
        return None
    if len(actual_times) > len(offsets):
        raise ValueError("more submit times than scheduled offsets")
    return [actual - (t0 + off) for actual, off in zip(actual_times, offsets)]


def request_arrival_offsets(
    n: int, request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Arrival offsets (seconds after t0) for ``bench serve``.

    ``request_rate`` is the mean requests/s; ``inf`` sends everything at once (all
    zeros). Otherwise gaps are gamma-distributed with shape=burstiness and
    scale=1/(request_rate*burstiness), so the mean gap is 1/request_rate whatever the
    burstiness, while the variance is 1/(rate^2 * burstiness): burstiness 1 is a
    Poisson process, < 1 burstier, > 1 more regular.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:  # also rejects NaN
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return _cumulative(gaps)
