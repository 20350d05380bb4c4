"""InProcessClient: the engine core steps in one background thread of this process; callers submit
and read streams.

A thread, not a process: the forward pass is torch kernels that release the GIL, so the HTTP event
loop keeps answering while a step runs (the measurements are in docs/profiling.md). The core in a
process of its own is EngineProcessClient (engine_client/process_client.py).

Threading rules:
- Only the worker thread touches the engine core. Callers build their request with
  `engine.new_request` (validation and the grammar; it reads immutable configuration only), so
  bad input fails in the caller's thread, then hand work over through the inbox (new requests,
  aborts) under the client's lock.
- The worker takes that lock once per step: it retires the ids that finished in the previous
  step and drains the inbox in the same acquisition. Its StreamTable (streams, OutputProcessor)
  is its own, so feeding the streams needs no lock.
- When there is no work the worker sleeps on the condition; submit/abort/shutdown notify it.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.engine.request import Request
from roseinfer.engine.structured_output import CompiledGrammar
from roseinfer.engine_client.client import SHUTDOWN_MESSAGE, FinishedHook, ShuttingDownError, admit
from roseinfer.engine_client.request_stream import RequestStream, deliver
from roseinfer.engine_client.stream_table import Deltas, StreamTable
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Submission:
    stream: RequestStream
    request: Request  # opaque here: built by engine.new_request, handed to the engine core
    prompt_ids: list[int]
    params: SamplingParams
    final_only: bool


class InProcessClient:
    def __init__(self, engine: LLMEngine, stream_interval: int = 1, max_inflight_requests: int | None = None,
                 on_finished: FinishedHook | None = None) -> None:
        if max_inflight_requests is not None and max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1 or None, got {max_inflight_requests}")
        self.engine = engine
        self.max_inflight_requests = max_inflight_requests
        self._cond = threading.Condition()
        # guarded by _cond
        self._new: list[_Submission] = []
        self._aborts: list[str] = []
        self._inflight: set[str] = set()
        self._stopping = False
        self._draining = False  # no new requests; the running ones finish until the deadline
        self._deadline_passed = False  # drain's time is up: fail what is still running
        # worker-only
        self._table = StreamTable(engine.tokenizer, stream_interval, on_finished)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stats = engine_stats(engine)

    # ---- caller side -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine client was already started")
        self._thread = threading.Thread(target=self._run, name="roseinfer-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Take no new requests; give the running ones `timeout` seconds to finish, then end each
        with SHUTDOWN_MESSAGE (HTTP 503) so that every client gets a terminal event."""
        with self._cond:
            self._draining = True
        # a second call (a second signal) with a shorter timeout ends the drain sooner
        timer = threading.Timer(timeout, self._pass_deadline)
        timer.daemon = True
        timer.start()

    def _pass_deadline(self) -> None:
        with self._cond:
            self._deadline_passed = True
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """End everything in flight (each stream gets a final delta with SHUTDOWN_MESSAGE), join the
        worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.down_reason is None

    @property
    def down_reason(self) -> str | None:
        # draining counts as down: /health then tells load balancers to send traffic elsewhere
        if self._stopping or self._draining:
            return SHUTDOWN_MESSAGE
        if self._thread is None or not self._thread.is_alive():
            return "the engine worker is not running"
        return None

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               submit_start: float | None = None, grammar: CompiledGrammar | None = None,
               pooling_params: PoolingParams | None = None, final_only: bool = False) -> RequestStream:
        """Queue a request; raises ValueError on bad input and OverloadedError past the limit.
        `grammar`: params.structured_outputs compiled by the caller (engine.compile_grammar), so that
        the worker never stalls a step on it. `pooling_params`: an embedding request (its final
        delta carries the vector).

        Submitting before start() is fine: the worker picks the request up once it runs.
        """
        tokenized = time.perf_counter()
        prompt_ids = list(prompt_ids)
        request_id = request_id if request_id is not None else f"srv-{next(self._ids)}"
        request = self.engine.new_request(prompt_ids, params, request_id, grammar, pooling_params)
        params = request.sampling_params
        timings = {"submit_start": tokenized if submit_start is None else submit_start, "tokenized": tokenized}
        stream = RequestStream(request_id, len(prompt_ids), timings)
        with self._cond:
            if self._stopping or self._draining:
                raise ShuttingDownError(SHUTDOWN_MESSAGE)
            admit(self._inflight, request_id, self.max_inflight_requests)
            timings["submit_end"] = time.perf_counter()
            self._new.append(_Submission(stream, request, prompt_ids, params, final_only))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown ids are ignored. Its slot under max_inflight_requests frees now,
        so that a client reconnecting right after a disconnect is admitted; its KV blocks free at
        the worker's next turn, before any new request is scheduled."""
        with self._cond:
            self._inflight.discard(request_id)
            self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> dict:
        """Engine counters as of the worker's last step, plus requests in flight here."""
        with self._cond:
            inflight = len(self._inflight)
        return {**self._stats, "num_inflight": inflight}

    # ---- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        done = self._table.done
        while True:
            with self._cond:
                self._inflight.difference_update(done)
                done.clear()
                while not (self._new or self._aborts or self._stopping or self._deadline_passed
                           or engine.has_unfinished()):
                    self._cond.wait()
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
                cut, self._deadline_passed = self._deadline_passed, False
            deltas: Deltas = []
            try:
                self._iterate(new, aborts, stopping or cut, deltas)
            except Exception as exc:  # noqa: BLE001 -- the worker must outlive any one bad step
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(f"internal engine error: {type(exc).__name__}: {exc}", deltas)
            self._stats = engine_stats(engine)
            deliver(deltas)
            if stopping:
                with self._cond:
                    self._inflight.difference_update(done)
                return

    def _iterate(self, new: list[_Submission], aborts: list[str], stopping: bool, deltas: Deltas) -> None:
        engine = self.engine
        for sub in new:
            try:
                engine.core.add(sub.request)
            except Exception as exc:  # noqa: BLE001 -- validated in submit(); whatever slips through fails one request
                logger.exception("could not add request %s", sub.stream.request_id)
                self._table.refuse(sub.stream, exc, deltas)
                continue
            self._table.open(sub.stream, sub.prompt_ids, sub.params, sub.final_only)
        if stopping:
            self._fail_all(SHUTDOWN_MESSAGE, deltas, status=503)
            return
        outputs: list[EngineCoreOutput] = [out for out in map(engine.abort_request, aborts) if out is not None]
        if engine.has_unfinished():
            outputs += engine.step()
        for request_id in self._table.process(outputs, deltas):
            engine.abort_request(request_id)  # a stop string ended it: free its blocks now
        engine.pop_finished_ids()

    def _fail_all(self, message: str, deltas: Deltas, status: int = 500) -> None:
        self._table.fail_all(message, status, deltas, self.engine.abort_request)
        try:
            self.engine.pop_finished_ids()
        except Exception:  # noqa: BLE001
            logger.exception("pop_finished_ids failed")


def engine_stats(engine: LLMEngine) -> dict:
    """The engine's counters as the server's /metrics reads them."""
    kv = engine.kv_cache_stats()
    return {"num_running": engine.num_running(), "num_waiting": engine.num_waiting(),
            "kv_cache_usage_ratio": kv["used_blocks"] / kv["total_blocks"],
            "kv_used_blocks": kv["used_blocks"], "kv_free_blocks": kv["free_blocks"],
            "kv_total_blocks": kv["total_blocks"], "num_preemptions": kv["num_preemptions"],
            "prefix_cache_queries": kv["prefix_cache_queries"], "prefix_cache_hits": kv["prefix_cache_hits"],
            **engine.speculative_stats()}
