"""Data-parallel serving: N engine replicas on Ray Serve behind the one FastAPI ingress.

`ReplicaSet` stands where the single-engine server has its engine client: serving.py calls
`submit` / `abort` on it and reads each request's deltas as a `ReplicaStream`, so every endpoint,
streaming, error and limit works as on one engine. The ingress tokenizes and validates (against
`EngineView`, engine_client/engine_view.py), the router (server/router.py) picks
a replica, and the replica (server/replica.py) streams StreamDeltas back through a Serve handle.

Each replica is its own Serve application of one deployment, so the router can address replica i,
and Serve replaces a replica whose actor dies or fails its health check. A request whose replica
fails before anything was streamed is sent to another replica; one that had already streamed ends
with an error event (503).

Ray is imported here, and this module only with --data-parallel-size > 1.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import ray
from ray import serve

from roseinfer.config import EngineConfig
from roseinfer.engine.structured_output import CompiledGrammar
from roseinfer.engine_client.client import SHUTDOWN_MESSAGE, OverloadedError, ShuttingDownError
from roseinfer.engine_client.engine_view import EngineView
from roseinfer.sampling_params import SamplingParams
from roseinfer.pooling_params import PoolingParams
from roseinfer.output_processor import StreamDelta
from roseinfer.server.metrics import RouterMetrics
from roseinfer.server.replica import EngineReplica
from roseinfer.server.router import ReplicaRouter

logger = logging.getLogger(__name__)
APP_PREFIX = "roseinfer-replica-"
MAX_ONGOING_REQUESTS = 4096  # Serve's default (5) would queue what the engine's scheduler should batch
HEALTH_CHECK_PERIOD_S = 2.0
METRICS_TIMEOUT_S = 5.0  # a replica being replaced is left out of a scrape rather than stalling it


@dataclass
class ReplicaStream:
    """One request's deltas from whichever replica serves it (serving.py reads it as a RequestStream)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    replica: int
    pooling_params: PoolingParams | None = None  # an embedding request
    finished: bool = False
    streamed: bool = False  # a delta arrived: a failure can no longer be retried elsewhere
    tried: list[int] = field(default_factory=list)
    wake_on_text: bool = False  # RequestStream's flag; a replica's deltas reach the ingress whole
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _pump: asyncio.Task | None = None

    async def batches(self) -> AsyncIterator[list[StreamDelta]]:
        """As RequestStream.batches: every delta queued since the last take, up to the final one."""
        while not self.finished:
            batch = [await self._queue.get()]
            while not batch[-1].finished and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self.finished = batch[-1].finished
            yield batch

    def end(self, message: str, status: int) -> None:
        """Finish the stream with an error event (its replica died, or the server is shutting down)."""
        self._queue.put_nowait(StreamDelta("", [], [], True, "abort", len(self.prompt_ids), 0, time.perf_counter(),
                                           message, status))


class ReplicaSet:
    """N engine replicas behind a router; the ingress's engine client."""

    def __init__(self, config: EngineConfig, num_replicas: int, router_policy: str = "prefix-affinity",
                 stream_interval: int = 1, max_inflight_requests: int | None = None,
                 ray_address: str | None = None) -> None:
        self.max_inflight_requests = max_inflight_requests
        self.router = ReplicaRouter(num_replicas, router_policy, config.block_size)
        self.metrics = RouterMetrics()
        self._owns_ray = not ray.is_initialized() and ray_address is None
        if not ray.is_initialized():
            cpus = {"num_cpus": max(os.cpu_count() or 1, num_replicas * replica_cpus(config))} if self._owns_ray else {}
            ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING, **cpus)
        serve.start(proxy_location="Disabled")  # the ingress is our uvicorn app: no Serve HTTP proxy
        options = {"max_ongoing_requests": MAX_ONGOING_REQUESTS, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
                   "ray_actor_options": {"num_cpus": replica_cpus(config)}}
        targets = [serve.RunTarget(EngineReplica.options(name=f"engine-{i}", **options).bind(config, stream_interval),
                                   name=f"{APP_PREFIX}{i}", route_prefix=None,
                                   logging_config={"enable_access_log": False}) for i in range(num_replicas)]
        self.handles = serve.run_many(targets)
        infos = [handle.info.remote().result() for handle in self.handles]
        self.engine = EngineView.of(config, min(i["max_model_len"] for i in infos),
                                    min(i["num_kv_blocks"] for i in infos))
        self._streams: dict[str, ReplicaStream] = {}
        self._draining = self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the EngineClient interface ---------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # drain() schedules onto it from the signal handler

    @property
    def is_alive(self) -> bool:
        return not (self._draining or self._stopping)

    @property
    def down_reason(self) -> str | None:
        return None if self.is_alive else SHUTDOWN_MESSAGE

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str, submit_start: float | None = None,
               grammar: CompiledGrammar | None = None, pooling_params: PoolingParams | None = None) -> ReplicaStream:
        """`grammar` is not sent: the replica compiles the constraint again (EngineView.compile_grammar)."""
        prompt_ids = list(prompt_ids)
        self.engine.validate(prompt_ids, params)
        if not self.is_alive:
            raise ShuttingDownError(SHUTDOWN_MESSAGE)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        limit = self.max_inflight_requests
        if limit is not None and len(self._streams) >= limit:
            raise OverloadedError(f"{len(self._streams)} requests are in flight (the limit is {limit}); retry shortly")
        decision = self.router.route(prompt_ids)
        if decision.prefix_hit:
            self.metrics.prefix_hits.labels(str(decision.replica)).inc()
        stream = ReplicaStream(request_id, prompt_ids, params, decision.replica, pooling_params)
        self._streams[request_id] = stream
        stream._pump = asyncio.get_running_loop().create_task(self._pump(stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel the request's call: Serve cancels the replica's generator, which aborts it there."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream._pump is not None:
            stream._pump.cancel()

    def drain(self, timeout: float) -> None:
        """Take no new requests; end what still runs after `timeout` seconds with SHUTDOWN_MESSAGE."""
        self._draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout, self._end_all)

    def shutdown(self) -> None:
        self._stopping = True
        self._end_all()

    def close(self) -> None:
        """Remove the replicas: with Ray itself if this process started it, else from the cluster."""
        if self._owns_ray:
            serve.shutdown()
            ray.shutdown()
            return
        for i in range(self.router.num_replicas):
            serve.delete(f"{APP_PREFIX}{i}")

    # ---- routing and streaming ---------------------------------------------------------------
    async def _pump(self, stream: ReplicaStream) -> None:
        """Move the replica's deltas into the stream; on a failure before the first delta, retry
        on a replica not tried yet."""
        router = self.router
        try:
            while True:
                replica = stream.replica
                stream.tried.append(replica)
                router.inflight[replica] += 1
                self.metrics.routed.labels(str(replica)).inc()
                call = self.handles[replica].options(stream=True).generate.remote(
                    stream.request_id, stream.prompt_ids, stream.params, stream.pooling_params)
                try:
                    async for delta in call:
                        stream.streamed = True
                        stream._queue.put_nowait(delta)
                    return
                except asyncio.CancelledError:
                    call.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 -- any failure of the call is the replica's
                    logger.warning("replica %d failed request %s: %s", replica, stream.request_id, exc)
                    self.metrics.replica_failures.labels(str(replica)).inc()
                    if stream.streamed or len(stream.tried) == router.num_replicas:
                        stream.end(f"engine replica {replica} failed: {type(exc).__name__}", 503)
                        return
                    stream.replica = router.route(stream.prompt_ids, exclude=tuple(stream.tried)).replica
                    self.metrics.retries.inc()
                finally:
                    router.inflight[replica] -= 1
        finally:
            self._streams.pop(stream.request_id, None)

    def _end_all(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            if stream._pump is not None:
                stream._pump.cancel()
            stream.end(SHUTDOWN_MESSAGE, 503)

    async def render_metrics(self) -> bytes:
        """The router's metrics, then each replica's engine metrics with a `replica` label."""
        async def scrape(i: int) -> bytes | None:
            try:
                return await asyncio.wait_for(self.handles[i].metrics_text.remote(), METRICS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 -- a replica being replaced is left out of this scrape
                logger.warning("replica %d did not report metrics: %s", i, exc)
                return None

        texts = await asyncio.gather(*(scrape(i) for i in range(self.router.num_replicas)))
        return self.metrics.render(self.router.inflight, dict(enumerate(texts)))


def replica_cpus(config: EngineConfig) -> int:
    """The CPUs Ray reserves for one replica: its torch threads (1 when unset)."""
    return config.num_threads or 1
