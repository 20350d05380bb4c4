"""Tensor-parallel ranks 1..N-1 as processes, and rank 0's handle on them (`RankProcesses`).

Each process builds a Worker (roseinfer/worker) and runs the calls rank 0 sends it, in order, over
its pipe: loading, sizing the pool (a collective every rank joins), and each step's `follow` (the
BatchLayout and the rows whose logits rank 0 takes, pickled once). A pipe per process is as cheap
as shared memory and cheaper than a gloo broadcast (docs/distributed.md), needs no size limit, and
tells a waiting rank at once (EOF) that rank 0 is gone.

Lifetime: the processes are spawned (torch.multiprocessing, daemon) when the engine starts and stopped
with it (`close`, also on garbage collection and at interpreter exit); every rank then leaves its
group (TensorParallel.leave). A rank exits when rank 0's process does, however it ends (SIGKILL
included): its pipe reads EOF, a collective loses its peer, and a thread watching its parent pid
catches the rest. It ignores SIGINT, so Ctrl-C at a terminal stops the engine's process, which stops
its ranks (a server drains first). A rank that dies (or fails and reports its traceback) makes rank
0's next collective fail at once (gloo sees the closed socket); rank 0 then stops the other ranks and
raises WorkerError naming the rank and why, and every later step raises it too. A hung rank is bounded
by the collectives' timeout.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseinfer.distributed.parallel import TensorParallel
from roseinfer.platforms import platform_for
from roseinfer.worker.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600  # a worker's start: importing torch, loading its share of the checkpoint
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # the most a rank waits for the others at one collective (a hang)
STOP_TIMEOUT_S = 1  # a stopped worker's grace (it exits in ~0.3 s) before SIGTERM, then SIGKILL


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot run further steps."""


class RankProcesses:
    """Rank 0's handle on ranks 1..size-1: start, the calls rank 0 sends them, failure, stop."""

    def __init__(self, spec: WorkerSpec, device: torch.device, num_threads: int) -> None:
        """num_threads: each rank's torch threads."""
        size = spec.world_size
        ctx = mp.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        self.procs: list[mp.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.error: WorkerError | None = None
        self._stopping = threading.Event()  # set once the workers are being stopped: their exits are expected
        self.tp = TensorParallel(0, size, None, device)  # its group once every rank has joined
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._stopping, self.tp)
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main,
                                   args=(spec, device, num_threads, rank, store.port, child, os.getpid()),
                                   name=f"roseinfer-tp-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self.tp.group = self._while_watching(lambda: _process_group(store, 0, size, device), "joining the group")
        except BaseException:
            self.close()
            raise
        self.store = store  # the workers' rendezvous: kept while the group lives
        threading.Thread(target=_watch, args=(self.tp, [proc.sentinel for proc in self.procs], self._stopping),
                         name="roseinfer-tp-watch", daemon=True).start()

    # ---- rank 0's side of the protocol ---------------------------------------------------
    def wait_ready(self) -> None:
        """Until every worker has loaded its share (each reports, or dies trying)."""
        for rank, conn in enumerate(self.conns, start=1):
            message = self._while_watching(conn.recv, "loading the model", rank)
            if message[0] != "ready":
                raise self._fail(f"rank {rank} failed while loading the model:\n{message[1]}")

    def call(self, method: str, *args: Any) -> None:
        """Every rank's Worker runs `method(*args)` (its side of what rank 0 does next)."""
        if self.error is not None:
            raise self.error
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:  # a broken pipe: that worker is gone
            raise self.failed(exc) from exc

    def failed(self, exc: BaseException, doing: str = "running a step") -> WorkerError:
        """The error to raise after `exc` interrupted a step or a call: which worker died and how.
        A step cut short (a KeyboardInterrupt too) leaves the ranks out of step, with workers waiting
        in a collective rank 0 left: the engine stops them all either way."""
        if self.error is not None:
            return self.error
        deadline = time.monotonic() + (3 if isinstance(exc, Exception) else 0)  # a crashed rank is reaped soon
        while time.monotonic() < deadline and all(proc.is_alive() for proc in self.procs):
            time.sleep(0.05)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return self._died(rank, doing)
        return self._fail(f"a step failed on rank 0 ({type(exc).__name__}: {exc})")

    def close(self) -> None:
        """Stop every worker (a no-op once done)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    # ---- watching ------------------------------------------------------------------------
    def _fail(self, what: str) -> WorkerError:
        self.error = WorkerError(f"tensor parallelism: {what}; the engine stopped its workers and "
                                 "cannot run further steps")
        self.close()
        return self.error

    def _while_watching(self, fn: Any, doing: str, rank: int | None = None) -> Any:
        """fn() in a thread while rank 0 watches the workers: a worker that dies (or runs past
        START_TIMEOUT_S) turns into a WorkerError instead of a wait that never ends."""
        result: list = []

        def run() -> None:
            try:
                result.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller's thread
                result.append((False, exc))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        ranks = range(1, len(self.procs) + 1) if rank is None else [rank]
        while True:
            thread.join(0.05)
            if not thread.is_alive():
                break
            dead = [r for r in ranks if not self.procs[r - 1].is_alive()]
            if dead:
                thread.join(0.5)  # a worker's last message may be on its way
                if not thread.is_alive():
                    break
                raise self._died(dead[0], doing)
            if time.monotonic() > deadline:
                raise self._fail(f"the workers took over {START_TIMEOUT_S} s {doing}")
        ok, value = result[0]
        if not ok:
            raise self._died(rank, doing) if isinstance(value, EOFError) and rank is not None else value
        return value

    def _died(self, rank: int, doing: str) -> WorkerError:
        proc = self.procs[rank - 1]
        return self._fail(f"rank {rank} (pid {proc.pid}) {_how(proc, self.conns[rank - 1])} while {doing}")


def _watch(tp: TensorParallel, sentinels: list[int], stopping: threading.Event) -> None:
    """A worker that dies while rank 0 waits in a collective: gloo notices the closed socket by
    itself; NCCL would wait out its timeout unless the group is aborted, which this does. (It holds
    rank 0's TensorParallel, not the RankProcesses, which the garbage collector may then stop.)"""
    multiprocessing.connection.wait(sentinels)
    group = tp.group
    if not stopping.is_set() and group is not None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 -- not every backend can abort; gloo needs not
            pass


def _how(proc: mp.Process, conn: multiprocessing.connection.Connection) -> str:
    """How a worker ended: its traceback when it reported one, else its exit code or signal."""
    try:
        if conn.poll(0):
            kind, detail = conn.recv()
            if kind == "error":
                return f"failed:\n{detail}"
    except (EOFError, OSError):
        pass
    proc.join(0.1)
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return "exited" if code is None else f"exited with code {code}"


def _stop(procs: list[mp.Process], conns: list[multiprocessing.connection.Connection],
          stopping: threading.Event, tp: TensorParallel) -> None:
    """Ask every worker to stop, then end those still there after STOP_TIMEOUT_S; rank 0 then
    leaves the group."""
    stopping.set()
    message = pickle.dumps(("stop", ()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
    # a worker left inside a collective by an interrupted step cannot read the message: it is ended
    for end in (None, mp.Process.terminate, mp.Process.kill):
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in procs:
            if end is not None and proc.is_alive():
                end(proc)
            proc.join(max(0.0, deadline - time.monotonic()))
    for conn in conns:
        conn.close()
    tp.leave()


def _process_group(store: dist.Store, rank: int, size: int, device: torch.device) -> Any:
    """This rank's member of the group: gloo on CPU, NCCL on CUDA (one GPU per rank). Built
    directly on the store, not as torch.distributed's default group, so that one process can hold
    several engines (the tests do)."""
    return platform_for(device).process_group(store, rank, size, COLLECTIVE_TIMEOUT)


# ---- a rank's process ------------------------------------------------------------------------
def _rank_main(spec: WorkerSpec, device: torch.device, num_threads: int, rank: int, port: int,
               conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        torch.set_num_threads(num_threads)
        device = platform_for(device).rank_device(rank)
        worker = Worker(spec, device)
        store = dist.TCPStore("127.0.0.1", port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        tp = TensorParallel(rank, spec.world_size, _process_group(store, rank, spec.world_size, device), device)
        worker.load_model(tp)
        conn.send(("ready", None))
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                break
            if method == "stop":
                break
            getattr(worker, method)(*args)
        tp.leave()
    except BaseException:  # noqa: BLE001 -- reported to rank 0, whose next collective then fails
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as rank 0's process is gone (we are re-parented), whatever killed it; a thread
    rather than PR_SET_PDEATHSIG, which fires when the *thread* that spawned us exits."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
