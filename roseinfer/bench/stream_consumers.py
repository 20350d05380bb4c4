"""The client side of ``bench streaming``: what it records per request, and who reads streams.

InProcessClient binds a stream to the thread that submits it: one submitted from a plain
thread is read with ``get()``, one submitted on an event loop with ``async for`` on that
loop. So a consumer here owns the submit call as well as the reading:

* ``ThreadConsumers``: submit in the caller's thread, then one client thread per stream
  blocks in ``get()``.
* ``CollectorConsumer``: one thread runs an asyncio loop (as the HTTP server does); each
  submission is handed to it, submitted there and iterated there.

Every token time is stamped where the consumer receives the delta.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .metrics import RequestTiming

CONSUMERS: tuple[str, ...] = ("threads", "collector")


@dataclass
class StreamRecord:
    """What the client saw of one request (perf_counter seconds)."""

    index: int
    submit_start: float  # when the client began: before tokenizing, unless pre-tokenized
    prompt_tokens: int = 0
    tokenize_s: float | None = None
    tokenized: float | None = None  # None when pre-tokenized: the prompt was ready all along
    submit_call_s: float | None = None  # the InProcessClient.submit call itself
    submit_end: float | None = None  # when submit returned to the client
    enqueued: float | None = None  # the manager's own submit end: admission cannot precede it
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)  # one stamp per delta carrying tokens
    num_tokens: int = 0
    end: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # "rejected" for OverloadedError, else what went wrong

    def timing(self) -> RequestTiming:
        # Queue wait is measured from the manager's enqueue time, not from when submit()
        # returned: the worker may admit the request before the client thread runs again.
        ready = self.enqueued if self.enqueued is not None else self.submit_end or self.submit_start
        return RequestTiming(self.submit_start, ready, self.tokenized, self.admitted, self.token_times,
                             self.end, self.num_tokens)

    def take(self, delta: Any, stream: Any) -> None:
        """Stamp one delta as it arrives."""
        now = time.perf_counter()
        if delta.token_ids:
            self.token_times.append(now)
            self.num_tokens += len(delta.token_ids)
        if delta.finished:
            self.end = now
            self.finish_reason = delta.finish_reason
            self.admitted = stream.timings.get("admitted")
            self.enqueued = stream.timings.get("submit_end")
            if delta.error:
                self.error = delta.error


# Submits one request and returns its stream, or None when the submission was refused
# (the refusal is recorded on the StreamRecord by the submitter).
SubmitFn = Callable[[], Any]


class ThreadConsumers:
    """Submit in the calling thread; one client thread per stream, blocked in ``get``."""

    def __init__(self, timeout: float, abort: Callable[[str], None]) -> None:
        self.timeout, self.abort = timeout, abort
        self.threads: list[threading.Thread] = []

    def start(self, rec: StreamRecord, submit: SubmitFn) -> None:
        stream = submit()
        if stream is None:
            return
        thread = threading.Thread(target=self._drain, args=(stream, rec), daemon=True)
        thread.start()
        self.threads.append(thread)  # list.append is atomic: tokenize workers may add at once

    def _drain(self, stream: Any, rec: StreamRecord) -> None:
        try:
            while True:
                delta = stream.get(timeout=self.timeout)
                rec.take(delta, stream)
                if delta.finished:
                    return
        except Exception as exc:  # noqa: BLE001 -- a failed stream is counted, not fatal
            _record_failure(rec, exc, stream, self.abort)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def close(self) -> None:
        """Nothing to release: every thread ends with its stream."""


class CollectorConsumer:
    """One thread running an asyncio loop that submits and iterates every stream."""

    def __init__(self, timeout: float, abort: Callable[[str], None]) -> None:
        self.timeout, self.abort = timeout, abort
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-collector", daemon=True)
        self.thread.start()
        self.futures: list[Any] = []

    def start(self, rec: StreamRecord, submit: SubmitFn) -> None:
        self.futures.append(asyncio.run_coroutine_threadsafe(self._run(rec, submit), self.loop))

    async def _run(self, rec: StreamRecord, submit: SubmitFn) -> None:
        stream = submit()  # on the loop, so the stream delivers to this loop
        if stream is None:
            return

        async def drain() -> None:
            async for delta in stream:
                rec.take(delta, stream)

        try:
            await asyncio.wait_for(drain(), self.timeout)
        except Exception as exc:  # noqa: BLE001 -- a failed stream is counted, not fatal
            _record_failure(rec, exc, stream, self.abort)

    def join(self) -> None:
        for future in self.futures:
            future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def make_consumer(kind: str, timeout: float, abort: Callable[[str], None]) -> ThreadConsumers | CollectorConsumer:
    if kind not in CONSUMERS:
        raise ValueError(f"unknown consumer {kind!r}; expected one of {', '.join(CONSUMERS)}")
    return CollectorConsumer(timeout, abort) if kind == "collector" else ThreadConsumers(timeout, abort)


def _record_failure(rec: StreamRecord, exc: Exception, stream: Any, abort: Callable[[str], None]) -> None:
    """A stream that failed or timed out is counted as failed and its request aborted (blocks freed)."""
    rec.error = f"{type(exc).__name__}: {exc}"
    abort(stream.request_id)
