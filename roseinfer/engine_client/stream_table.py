"""StreamTable: the streams an engine client feeds and the OutputProcessor that turns the core's
outputs into their deltas (text, stop strings, flushes). Owned by the one thread that reads the
core's outputs: the in-process worker, or the process client's output thread."""
from __future__ import annotations

import logging
import time
from typing import Callable

from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.engine_client.client import FinishedHook
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.output_processor import OutputProcessor, StreamDelta
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Deltas = list[tuple[RequestStream, StreamDelta]]


class StreamTable:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int, on_finished: FinishedHook | None) -> None:
        self.processor = OutputProcessor(tokenizer, stream_interval)
        self.on_finished = on_finished  # called with each final delta (metrics)
        self.streams: dict[str, RequestStream] = {}
        self.done: list[str] = []  # finalized since the owner last took them (its in-flight count)

    def open(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams,
             final_only: bool = False) -> None:
        self.streams[stream.request_id] = stream
        self.processor.add_request(stream.request_id, prompt_ids, params, final_only)

    def refuse(self, stream: RequestStream, exc: Exception, deltas: Deltas) -> None:
        """End a request the core would not take (a ValueError is the request's fault: a 400)."""
        status = 400 if isinstance(exc, ValueError) else 500
        deltas.append((stream, StreamDelta("", [], [], True, "abort", stream.num_prompt_tokens, 0, time.perf_counter(),
                                           str(exc), status)))
        self.done.append(stream.request_id)

    def process(self, outputs: list[EngineCoreOutput], deltas: Deltas) -> list[str]:
        """One step's outputs into deltas; the ids a stop string ended, to abort in the core."""
        processed = self.processor.process(outputs, time.perf_counter())
        for request_id, delta in processed.deltas:
            self.route(request_id, delta, deltas)
        return processed.stopped_ids

    def fail_all(self, message: str, status: int, deltas: Deltas,
                 abort: Callable[[str], EngineCoreOutput | None]) -> None:
        """End every open stream with an error; `abort` ends each request in the core (its final
        output, whose timestamps the delta then carries, or None)."""
        now = time.perf_counter()
        for request_id in self.processor.request_ids():
            aborted = None
            try:
                aborted = abort(request_id)
            except Exception:  # noqa: BLE001 -- the engine is already in trouble; free what we can
                logger.exception("abort of %s failed", request_id)
            self.route(request_id, self.processor.fail(request_id, message, status, now, aborted), deltas)

    def route(self, request_id: str, delta: StreamDelta, deltas: Deltas) -> None:
        """A delta to its stream; the first records the core's admission and first-token times, the
        final one its end."""
        stream = self.streams[request_id]
        if delta.times is not None:
            for key, value in (("admitted", delta.times.admitted), ("first_token", delta.times.first_token)):
                if value is not None:
                    stream.timings.setdefault(key, value)
        deltas.append((stream, delta))
        if not delta.finished:
            return
        del self.streams[request_id]
        stream.timings["finished"] = delta.timestamp
        self.done.append(request_id)
        if self.on_finished is not None:
            try:
                self.on_finished(stream, delta)
            except Exception:  # noqa: BLE001 -- a metrics bug must not take the engine down
                logger.exception("on_finished hook failed")
