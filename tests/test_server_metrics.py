"""GapHistogram: a request's inter-token gaps bucketed at once give the exposition that
prometheus_client's Histogram gives one observe() a gap."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from roseinfer.server.metrics import TOKEN_GAP_BUCKETS, GapHistogram

NAME = "roseinfer_inter_token_latency_seconds"


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    family = next(f for f in text_string_to_metric_families(generate_latest(registry).decode()) if f.name == NAME)
    return {(s.name, s.labels.get("le", "")): s.value for s in family.samples if not s.name.endswith("_created")}


def test_gap_histogram_matches_prometheus_histogram() -> None:
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, "gaps", buckets=TOKEN_GAP_BUCKETS, registry=one_by_one)
    gaps = GapHistogram(NAME, "gaps", TOKEN_GAP_BUCKETS, batched)
    rng = random.Random(0)
    gaps.observe_gaps([])
    for length in (0, 1, 2, 40, 129):
        times = [0.0, 0.05]  # a gap exactly on an edge: in that edge's bucket
        for _ in range(length):
            times.append(times[-1] + rng.choice([0.5, 12.0, rng.expovariate(8.0)]))
        for earlier, later in zip(times, times[1:]):
            reference.observe(later - earlier)
        gaps.observe_gaps(times)
    expected, got = samples(one_by_one), samples(batched)
    assert expected[(NAME + "_count", "")] > 100
    sum_key = (NAME + "_sum", "")
    assert got.pop(sum_key) == pytest.approx(expected.pop(sum_key))
    assert got == expected
