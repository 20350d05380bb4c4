"""EngineClient: what a server (or a benchmark) holds of an engine. Submit a request and read its
deltas, abort it, read the engine's counters, ask whether it runs and why not, drain, shut down.
Two implementations: InProcessClient (the core in a worker thread of this process,
engine_client/in_process.py) and EngineProcessClient (the core in a process of its own,
engine_client/process_client.py); `make_engine_client` (engine_client/select.py) picks one."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from roseinfer.engine.structured_output import CompiledGrammar
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.output_processor import StreamDelta
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.engine_client.engine_view import EngineView

SHUTDOWN_MESSAGE = "the server is shutting down"


class OverloadedError(Exception):
    """More requests in flight than `max_inflight_requests` allows (HTTP 429)."""


class ShuttingDownError(RuntimeError):
    """The client takes no new requests: it is draining, shut down, or its engine died (HTTP 503)."""


FinishedHook = Callable[[RequestStream, StreamDelta], None]  # the final delta carries the core's timestamps


class EngineClient(Protocol):
    # what the HTTP layer reads of the engine: tokenizer, configuration, limits, validate, compile_grammar
    engine: LLMEngine | EngineView
    max_inflight_requests: int | None

    def start(self) -> None: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               submit_start: float | None = None, grammar: CompiledGrammar | None = None,
               pooling_params: PoolingParams | None = None) -> RequestStream:
        """Queue a request; ValueError on bad input (nothing reached the engine), OverloadedError past
        the limit, ShuttingDownError when the client takes no more. `pooling_params`: an embedding
        request. The local clients also take final_only (LLM's way: OutputProcessor.add_request)."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def down_reason(self) -> str | None:
        """Why the client takes no requests (draining, shut down, its engine died); None while it does."""

    def drain(self, timeout: float) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


def admit(inflight: set[str], request_id: str, limit: int | None) -> None:
    """Count a new request in flight, or refuse it: an id in use (ValueError), past the limit
    (OverloadedError)."""
    if request_id in inflight:
        raise ValueError(f"request id {request_id!r} is already in flight")
    if limit is not None and len(inflight) >= limit:
        raise OverloadedError(f"{len(inflight)} requests are in flight (the limit is {limit}); retry shortly")
    inflight.add(request_id)
