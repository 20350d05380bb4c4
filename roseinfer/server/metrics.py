"""Prometheus metrics, `roseinfer_` prefix, one CollectorRegistry per app (tests build several).

With --data-parallel-size, each replica keeps its own ServerMetrics and the ingress a RouterMetrics,
which serves the router's counters and every replica's metrics, each sample labelled `replica`.

Per-request numbers are recorded once, when a request finishes (the engine client's
on_finished hook, in the worker: a handful of counter/histogram updates, microseconds). Gauges and
the prefix-cache counters are engine state, read from the engine client's stats() at scrape time.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from roseinfer.output_processor import StreamDelta
from roseinfer.engine_client.request_stream import RequestStream

# vLLM's bucket edges, so dashboards built for it read ours the same way
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


INGRESS_FAMILIES = ("roseinfer_requests_rejected", "roseinfer_http_responses", "roseinfer_endpoint_responses")


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("roseinfer_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("roseinfer_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge("roseinfer_kv_cache_usage_ratio", "Fraction of KV blocks in use (0 when idle)",
                              registry=r)
        self.prompt_tokens = Counter("roseinfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("roseinfer_generation_tokens", "Generated tokens", registry=r)
        self.prefix_queries = Counter("roseinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("roseinfer_prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                   registry=r)
        self.requests = Counter("roseinfer_requests", "Finished requests, by how the engine ended them (a response "
                                "that failed after that is a 5xx in roseinfer_http_responses)", ["finish_reason"],
                                registry=r)
        self.rejected = rejected_counter(r)
        self.responses = responses_counter(r)
        self.endpoint_responses = endpoint_counter(r)
        self.kv_used = Gauge("roseinfer_kv_cache_used_blocks", "KV blocks held by requests", registry=r)
        self.kv_free = Gauge("roseinfer_kv_cache_free_blocks", "KV blocks free or only prefix-cached (evictable)",
                             registry=r)
        self.preemptions = Counter("roseinfer_num_preemptions", "Requests preempted (blocks freed, recomputed "
                                   "later) since the engine started", registry=r)
        # speculative decoding (vLLM's spec_decode names); mean accepted length = 1 + accepted / drafts
        self.spec_drafts = Counter("roseinfer_spec_decode_num_drafts", "Drafts verified (one per speculating "
                                   "request per step)", registry=r)
        self.spec_draft_tokens = Counter("roseinfer_spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.spec_accepted = Counter("roseinfer_spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                     registry=r)
        self.spec_mean_length = Gauge("roseinfer_spec_decode_mean_accepted_length", "Tokens emitted per verified "
                                      "draft since the engine started (0 before the first)", registry=r)
        self.ttft = Histogram("roseinfer_time_to_first_token_seconds", "Submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = GapHistogram("roseinfer_inter_token_latency_seconds", "Gap between consecutive tokens",
                                TOKEN_GAP_BUCKETS, r)
        self.e2e = Histogram("roseinfer_e2e_request_latency_seconds", "Submission to the last token",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("roseinfer_request_queue_time_seconds", "Engine arrival to admission",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram("roseinfer_request_prefill_time_seconds", "Admission to first token",
                                      buckets=REQUEST_BUCKETS, registry=r)
        self._counted = {"prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                         "num_preemptions": self.preemptions, "spec_num_drafts": self.spec_drafts,
                         "spec_num_draft_tokens": self.spec_draft_tokens,
                         "spec_num_accepted_tokens": self.spec_accepted}
        self._seen = dict.fromkeys(self._counted, 0)  # at the last scrape

    def observe_finished(self, stream: RequestStream, final: StreamDelta) -> None:
        """The engine client's on_finished hook."""
        self.requests.labels(final.finish_reason or "abort").inc()
        self.generation_tokens.inc(final.num_output_tokens)
        start = stream.timings["submit_start"]
        self.e2e.observe(final.timestamp - start)
        core = final.times
        if core is None or core.admitted is None:  # aborted while waiting: no prompt was computed
            return
        self.prompt_tokens.inc(final.num_prompt_tokens)
        self.queue_time.observe(core.admitted - core.arrival)
        if core.first_token is not None:
            self.ttft.observe(core.first_token - start)
            self.prefill_time.observe(core.first_token - core.admitted)
        self.itl.observe_gaps(core.token_times)

    def render(self, stats: dict) -> bytes:
        """The Prometheus text exposition, gauges refreshed from `stats` first."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage_ratio"])
        self.kv_used.set(stats["kv_used_blocks"])
        self.kv_free.set(stats["kv_free_blocks"])
        # the engine keeps running totals; the counters take what came since the last scrape
        self.spec_mean_length.set(stats["spec_mean_accepted_length"])
        for key, counter in self._counted.items():
            counter.inc(max(0, stats[key] - self._seen[key]))
            self._seen[key] = stats[key]
        return generate_latest(self.registry)


class GapHistogram:
    """A Prometheus histogram of the gaps between consecutive timestamps, a request's whole list
    bucketed at once with numpy: prometheus_client's Histogram takes one value a call, and a
    request has one gap per output token."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.edges = np.array(buckets)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: above every edge (+Inf)
        self.total = 0.0
        self._lock = threading.Lock()  # observed on the engine client's thread, collected on a scrape's
        registry.register(self)

    def observe_gaps(self, times: list[float]) -> None:
        if len(times) < 2:
            return
        gaps = np.diff(times)
        # le buckets: a gap equal to an edge counts in that edge's bucket, as Histogram.observe does
        counts = np.bincount(np.searchsorted(self.edges, gaps), minlength=len(self.counts))
        with self._lock:
            self.counts += counts
            self.total += float(gaps.sum())

    def collect(self) -> list[Metric]:
        with self._lock:
            cumulative, total = np.cumsum(self.counts).tolist(), self.total
        bounds = [floatToGoString(edge) for edge in self.edges.tolist()] + ["+Inf"]
        return [HistogramMetricFamily(self.name, self.documentation, list(zip(bounds, cumulative)), total)]


def rejected_counter(registry: CollectorRegistry) -> Counter:
    """Counted where HTTP requests arrive: the server's app, or the ingress in front of replicas."""
    return Counter("roseinfer_requests_rejected", "Requests refused before they ran, by reason", ["reason"],
                   registry=registry)


def responses_counter(registry: CollectorRegistry) -> Counter:
    """Counted where HTTP requests arrive, as rejected_counter; status is the class: 2xx, 4xx, 5xx."""
    return Counter("roseinfer_http_responses", "HTTP responses sent, by status class (a 5xx is a server fault)",
                   ["status"], registry=registry)


def endpoint_counter(registry: CollectorRegistry) -> Counter:
    """The API endpoints' responses apart, by endpoint (its path) and status class, counted as
    responses_counter's; other paths (health checks, scrapes, unknown URLs) only there."""
    return Counter("roseinfer_endpoint_responses", "Responses of each API endpoint, by path and status class",
                   ["endpoint", "status"], registry=registry)


class CountResponses:
    """ASGI middleware counting every HTTP response by its status class as it starts. An exception
    that escapes before any response counts as the 500 that Starlette then sends; a stream that
    fails after its 200 has begun ends with an error event and stays a 2xx."""

    def __init__(self, app: Any, counter: Counter, endpoint_counter: Counter, endpoints: frozenset[str]) -> None:
        """endpoints: the paths endpoint_counter counts apart, labelled as given (a fixed set: no
        label per unknown URL); a `{name}` segment matches any one segment (a response's id)."""
        self.app, self.counter = app, counter
        self.endpoint_counter, self.endpoints = endpoint_counter, endpoints
        self.templates = [(t, t.split("/")) for t in endpoints if "{" in t]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        endpoint = self.endpoint(scope["path"])

        def count(status: str) -> None:
            self.counter.labels(status).inc()
            if endpoint is not None:
                self.endpoint_counter.labels(endpoint, status).inc()

        async def counted(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                count(f"{message['status'] // 100}xx")
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                count("5xx")
            raise


    def endpoint(self, path: str) -> str | None:
        if path in self.endpoints:
            return path
        segments = path.split("/")
        for template, parts in self.templates:
            if len(parts) == len(segments) and all(
                    p == s or (p.startswith("{") and s) for p, s in zip(parts, segments)):
                return template
        return None


class RouterMetrics:
    """The ingress's metrics in front of engine replicas: rejections, routing, and the replicas' own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rejected = rejected_counter(r)
        self.responses = responses_counter(r)
        self.endpoint_responses = endpoint_counter(r)
        self.routed = Counter("roseinfer_router_requests", "Requests sent to each replica (a retry counts again)",
                              ["replica"], registry=r)
        self.prefix_hits = Counter("roseinfer_router_prefix_affinity_hits", "Requests sent to the replica that got "
                                   "their prompt prefix before", ["replica"], registry=r)
        self.retries = Counter("roseinfer_router_retries", "Requests sent to another replica after theirs failed "
                               "before streaming anything", registry=r)
        self.replica_failures = Counter("roseinfer_router_replica_failures", "Calls that failed in a replica (it "
                                        "died or could not be reached)", ["replica"], registry=r)
        self.inflight = Gauge("roseinfer_router_requests_inflight", "Requests in flight per replica", ["replica"],
                              registry=r)
        self.up = Gauge("roseinfer_router_replica_up", "1 when the replica answered this scrape", ["replica"],
                        registry=r)

    def render(self, inflight: list[int], replica_texts: dict[int, bytes | None]) -> bytes:
        """The router's exposition, then the replicas' merged into one family per name."""
        for i, count in enumerate(inflight):
            self.inflight.labels(str(i)).set(count)
        merged: dict[str, Metric] = {}
        for replica, text in replica_texts.items():
            self.up.labels(str(replica)).set(text is not None)
            for family in text_string_to_metric_families((text or b"").decode()):
                if family.name in INGRESS_FAMILIES:  # counted here, at the ingress
                    continue
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                out.samples += [s._replace(labels={**s.labels, "replica": str(replica)}) for s in family.samples]
        replicas = CollectorRegistry()
        replicas.register(_Families(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(replicas)


class _Families:
    """A collector of already-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
