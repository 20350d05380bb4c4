"""One engine replica as a Ray Serve deployment: an engine client in a Ray actor, its engine in the
actor's process or in one of its own (--engine-process).

Imported only by server/replicas.py, and so only with --data-parallel-size > 1: this module imports
Ray. The ingress (today's FastAPI app, in the `roseinfer serve` process) tokenizes and validates, then
streams token ids in and StreamDeltas out through `generate`; everything engine-side is the
single-engine server's own code. Serve calls `check_health` every few seconds and replaces a replica
whose actor died or whose engine worker stopped.
"""
from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

from ray import serve

from roseinfer.config import EngineConfig
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.output_processor import StreamDelta
from roseinfer.engine_client.select import make_engine_client
from roseinfer.server.metrics import ServerMetrics
from roseinfer.engine.structured_output import compile_pool


@serve.deployment
class EngineReplica:
    def __init__(self, config: EngineConfig, stream_interval: int) -> None:
        self.metrics = ServerMetrics()
        self.manager = make_engine_client(config, stream_interval, on_finished=self.metrics.observe_finished)
        self.engine = self.manager.engine
        self.manager.start()
        self.compile_pool = compile_pool()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pooling_params: PoolingParams | None = None) -> AsyncIterator[StreamDelta]:
        """The request's deltas, the last one `finished`. Serve cancels this generator when the
        ingress cancels the call (the client went away): the request is then aborted here, which
        frees its KV blocks at the worker's next turn."""
        grammar = None
        if params.structured_outputs is not None:  # as the ingress does: not in the engine's step loop, deep stack
            grammar = await asyncio.get_running_loop().run_in_executor(
                self.compile_pool, self.engine.compile_grammar, params.structured_outputs)
        stream = self.manager.submit(prompt_ids, params, request_id, grammar=grammar, pooling_params=pooling_params)
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self.manager.abort(request_id)

    def info(self) -> dict:
        """What the ingress needs to check requests as this engine would, and to find this process."""
        engine = self.engine
        return {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.num_kv_blocks, "pid": os.getpid()}

    def metrics_text(self) -> bytes:
        """This engine's Prometheus exposition (the single-engine server's /metrics body)."""
        return self.metrics.render(self.manager.stats())

    def check_health(self) -> None:
        reason = self.manager.down_reason
        if reason is not None:
            raise RuntimeError(reason)

    def __del__(self) -> None:
        self.manager.shutdown()
