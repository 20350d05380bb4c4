"""make_engine_client: the engine core in this process or in its own, as EngineConfig.engine_process
says (auto: see uses_engine_process)."""
from __future__ import annotations

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine_client.client import EngineClient, FinishedHook
from roseinfer.engine_client.in_process import InProcessClient
from roseinfer.engine_client.process_client import EngineProcessClient


def uses_engine_process(config: EngineConfig) -> bool:
    """auto: a process of its own (the forward, scheduler and sampler then share no GIL with the HTTP
    loop, detokenization and stop strings; docs/profiling.md has the measurements)."""
    return config.engine_process != "off"


def make_engine_client(config: EngineConfig, stream_interval: int = 1, max_inflight_requests: int | None = None,
                       on_finished: FinishedHook | None = None) -> EngineClient:
    """The engine built from `config`, behind the client its engine_process asks for (not started)."""
    if uses_engine_process(config):
        return EngineProcessClient(config, stream_interval, max_inflight_requests, on_finished)
    return InProcessClient(LLMEngine(config), stream_interval, max_inflight_requests, on_finished)
