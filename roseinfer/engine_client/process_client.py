"""EngineProcessClient: the engine core in a process of its own (engine_client/core_process.py), this
process keeping what turns its outputs into text and streams: the OutputProcessor (detokenization,
stop strings; a matched stop string sends an abort to the core) and the HTTP loop. The forward, the
scheduler and the sampler then never share a GIL with the server.

Requests are checked here before anything is sent (EngineView: vocabulary, context, KV pool, the
grammar compiled once here for its 400), then go to the core as ADD messages; every turn of the
core's loop comes back as one CoreOutputs message, read by this client's output thread, which owns
the StreamTable. A dead engine process fails every open request with its reason, and the client
then refuses new ones; shutting down stops the process and leaves none behind.

Threading: the socket to the core is shared by submit / abort (any thread) and the output thread,
so each send holds the lock; the socket from the core and the StreamTable are the output thread's."""
from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import zmq

from roseinfer.config import EngineConfig
from roseinfer.engine.structured_output import CompiledGrammar
from roseinfer.engine_client.client import SHUTDOWN_MESSAGE, FinishedHook, ShuttingDownError, admit
from roseinfer.engine_client.core_process import run_engine_core
from roseinfer.engine_client.engine_view import EngineView
from roseinfer.engine_client.messages import ABORT, ADD, RESET_PREFIX_CACHE, AddRequest, encoder, outputs_decoder
from roseinfer.engine_client.request_stream import RequestStream, deliver
from roseinfer.engine_client.stream_table import Deltas, StreamTable
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
POLL_MS = 50  # how soon the output thread sees a drain's deadline or a shutdown with nothing arriving
STOP_TIMEOUT_S = 10.0  # a core that has not exited this long after SHUTDOWN is killed


class EngineProcessClient:
    def __init__(self, config: EngineConfig, stream_interval: int = 1, max_inflight_requests: int | None = None,
                 on_finished: FinishedHook | None = None) -> None:
        if max_inflight_requests is not None and max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1 or None, got {max_inflight_requests}")
        self.max_inflight_requests = max_inflight_requests
        self._folder = tempfile.mkdtemp(prefix="roseinfer-engine-")  # the two ipc:// sockets
        inbox, outbox = f"ipc://{self._folder}/inbox", f"ipc://{self._folder}/outbox"
        self._context = zmq.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # connected, unbounded: a send queues and never blocks
        self._to_core.connect(inbox)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.bind(outbox)
        spawn = multiprocessing.get_context("spawn")
        self._conn, child_conn = spawn.Pipe()
        # not a daemon: the core spawns the tensor-parallel ranks, and daemons may have no children
        self.process = spawn.Process(target=run_engine_core, args=(config, inbox, outbox, child_conn),
                                     name="roseinfer-engine-core")
        self.process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self._conn, self._context, self._folder)
        info = self._wait_ready()
        self.engine = EngineView.of(config, info["max_model_len"], info["num_kv_blocks"])
        self._lock = threading.Lock()
        # guarded by _lock
        self._pending: list[tuple[RequestStream, list[int], SamplingParams, bool]] = []  # sent, not yet in the table
        self._inflight: set[str] = set()
        self._stopping = self._draining = self._deadline_passed = False
        self._dead: str | None = None  # why the engine process is gone
        # output thread only
        self._table = StreamTable(self.engine.tokenizer, stream_interval, on_finished)
        self._stats: dict[str, Any] = info["stats"]
        self._ids = 0
        self._thread: threading.Thread | None = None

    def _wait_ready(self) -> dict[str, Any]:
        """The core's limits once its engine is built; its own exception if building failed."""
        try:
            wait([self._conn, self.process.sentinel])
            if not self._conn.poll():
                raise RuntimeError(f"the engine process exited while starting ({_exit_reason(self.process)})")
            status, value = self._conn.recv()
        except BaseException:
            self._finalizer()
            raise
        if status == "failed":
            self._finalizer()
            raise value
        return value

    # ---- caller side -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine client was already started")
        self._thread = threading.Thread(target=self._run, name="roseinfer-engine-outputs", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               submit_start: float | None = None, grammar: CompiledGrammar | None = None,
               pooling_params: PoolingParams | None = None, final_only: bool = False) -> RequestStream:
        """Queue a request; ValueError on bad input, before anything is sent. `grammar`: the caller's
        compiled constraint, which proves it compiles; the engine process compiles its own.
        `pooling_params`: an embedding request (its final delta carries the vector)."""
        tokenized = time.perf_counter()
        prompt_ids = list(prompt_ids)
        self.engine.validate(prompt_ids, params)
        if grammar is None and params.structured_outputs is not None:
            self.engine.compile_grammar(params.structured_outputs)
        timings = {"submit_start": tokenized if submit_start is None else submit_start, "tokenized": tokenized}
        with self._lock:
            if request_id is None:
                request_id, self._ids = f"srv-{self._ids}", self._ids + 1
            reason = self._down_reason()
            if reason is not None:
                raise ShuttingDownError(reason)
            admit(self._inflight, request_id, self.max_inflight_requests)
            stream = RequestStream(request_id, len(prompt_ids), timings)
            self._pending.append((stream, prompt_ids, params, final_only))
            self._to_core.send_multipart((ADD, encoder.encode(AddRequest(request_id, prompt_ids, params, tokenized, pooling_params))))
            timings["submit_end"] = time.perf_counter()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown ids are ignored. Its slot under max_inflight_requests frees now;
        its stream ends when the core's final output for it comes back."""
        with self._lock:
            self._inflight.discard(request_id)
            self._send_aborts([request_id])

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks nobody uses; requests submitted after this call find none of them."""
        with self._lock:
            if self._dead is None:
                self._to_core.send_multipart((RESET_PREFIX_CACHE, b""))

    def stats(self) -> dict:
        """The engine's counters as of its last message, plus requests in flight here."""
        with self._lock:
            inflight = len(self._inflight)
        return {**self._stats, "num_inflight": inflight}

    @property
    def is_alive(self) -> bool:
        return self.down_reason is None

    @property
    def down_reason(self) -> str | None:
        with self._lock:
            return self._down_reason()

    def _down_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        if self._stopping or self._draining:
            return SHUTDOWN_MESSAGE
        if self._thread is None or not self._thread.is_alive():
            return "the engine client is not running"
        return None

    def drain(self, timeout: float) -> None:
        """Take no new requests; give the running ones `timeout` seconds to finish, then end each
        with SHUTDOWN_MESSAGE (HTTP 503)."""
        with self._lock:
            self._draining = True
        timer = threading.Timer(timeout, self._pass_deadline)
        timer.daemon = True
        timer.start()

    def _pass_deadline(self) -> None:
        with self._lock:
            self._deadline_passed = True

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """End everything in flight with SHUTDOWN_MESSAGE, stop the engine process (killed if it has
        not exited within `timeout`) and the output thread."""
        with self._lock:
            self._stopping = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._finalizer()

    # ---- output thread -----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        table = self._table
        while True:
            try:
                events = dict(poller.poll(POLL_MS))
            except zmq.ZMQError:  # the sockets are gone: the client was finalized (at exit) without shutdown()
                return
            with self._lock:
                self._inflight.difference_update(table.done)
                table.done.clear()
                stopping = self._stopping
                cut, self._deadline_passed = self._deadline_passed, False
            deltas: Deltas = []
            self._read_outputs(deltas)
            if self.process.sentinel in events and self._dead is None:
                self._read_outputs(deltas)  # what it sent before it died
                self.process.join(POLL_MS / 1000)  # its pipes close a moment before its exit status is there
                reason = f"the engine process died ({_exit_reason(self.process)})"
                logger.error("%s; failing the %d requests in flight", reason, len(table.streams))
                with self._lock:
                    self._dead = reason
                poller.unregister(self.process.sentinel)  # readable from now on
                self._open_pending()
                table.fail_all(reason, 500, deltas, lambda _: None)
            if stopping or cut:
                self._open_pending()
                failed: list[str] = []
                table.fail_all(SHUTDOWN_MESSAGE, 503, deltas, lambda request_id: failed.append(request_id))
                with self._lock:
                    self._send_aborts(failed)
            deliver(deltas)
            if stopping:
                return

    def _read_outputs(self, deltas: Deltas) -> None:
        """Every message the core has sent so far, through the table; stop strings' aborts sent back."""
        table = self._table
        while True:
            try:
                body = self._from_core.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = outputs_decoder.decode(body)
            self._open_pending()  # every request this message may carry was sent, so pending, before it
            self._stats = message.stats
            stopped = table.process(message.outputs, deltas)
            if message.failure is not None:
                stopped += table.streams.keys() - stopped
                table.fail_all(message.failure, 500, deltas, lambda _: None)
            if stopped:
                with self._lock:
                    self._send_aborts(stopped)

    def _open_pending(self) -> None:
        """The requests submitted since the last call, into the table."""
        with self._lock:
            pending, self._pending = self._pending, []
        for stream, prompt_ids, params, final_only in pending:
            self._table.open(stream, prompt_ids, params, final_only)

    def _send_aborts(self, request_ids: list[str]) -> None:
        """Under the lock."""
        if request_ids and self._dead is None:
            self._to_core.send_multipart((ABORT, encoder.encode(request_ids)))


def _exit_reason(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(process: multiprocessing.process.BaseProcess, conn: Connection, context: zmq.Context, folder: str) -> None:
    """Tell the core to stop (closing its pipe is the signal: it stops between two steps), wait, kill it if it lingers; then the
    sockets and their folder. Also run at exit and when the client is garbage-collected."""
    conn.close()
    process.join(STOP_TIMEOUT_S)
    if process.is_alive():
        logger.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
        process.kill()
        process.join()
    context.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
