"""How rank 0 should hand each step to the other tensor-parallel ranks: the three ways measured on
real step messages (the pickled BatchLayout and logit rows of a decode step at batch 1 and 64, and
of a 2048-token prefill step).

  pipe   one multiprocessing pipe per worker, the pickle written to each (what roseinfer does)
  shm    nano-vllm's: the pickle written once into shared memory, then an Event per worker
  gloo   a torch.distributed broadcast of the pickle's length, then of its bytes

Each round: rank 0 pickles and sends, the worker receives and unpickles, then both meet in a
one-element gloo all-reduce (as the step's first collective orders the next message). `none` is
that all-reduce alone: a method's cost is its round minus `none`.

Usage: python benchmarks/tp_broadcast.py [--rounds 2000] [--methods none,pipe,shm,gloo]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseinfer.backends.base import BatchLayout

SHM_BYTES = 1 << 22


def step_message(decodes: int, prefill_tokens: int, context: int = 100, block_size: int = 16) -> bytes:
    """A step's message as the engine pickles it: `decodes` sequences decoding at `context`, plus
    one prompt chunk of `prefill_tokens`."""
    layout = BatchLayout(block_size, [], [], [], [], [], [], [])
    for seq in range(decodes + (1 if prefill_tokens else 0)):
        rows = 1 if seq < decodes else prefill_tokens
        start = context if seq < decodes else 0
        layout.q_starts.append(len(layout.input_ids))
        layout.q_lens.append(rows)
        layout.kv_lens.append(start + rows)
        table = [seq * 200 + b for b in range(-(-(start + rows) // block_size))]
        layout.block_tables.append(table)
        layout.input_ids.extend((seq * 31 + p) % 49152 for p in range(start, start + rows))
        layout.positions.extend(range(start, start + rows))
        layout.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + rows))
    logit_rows = [list(range(decodes))] if decodes else [[prefill_tokens - 1]]
    return pickle.dumps(("step", (layout, logit_rows)), protocol=pickle.HIGHEST_PROTOCOL)


def worker(method: str, port: int, conn, shm_name: str | None, event, rounds: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    shm = SharedMemory(shm_name) if shm_name else None
    one, size = torch.zeros(1), torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        if method == "pipe":
            pickle.loads(conn.recv_bytes())
        elif method == "shm":
            event.wait()
            event.clear()
            n = int.from_bytes(shm.buf[:8], "little")
            pickle.loads(shm.buf[8:8 + n])
        elif method == "gloo":
            group.broadcast(size, 0).wait()
            data = torch.empty(int(size), dtype=torch.uint8)
            group.broadcast(data, 0).wait()
            pickle.loads(data.numpy().tobytes())
        group.allreduce([one]).wait()
    if shm is not None:
        shm.close()


def rounds_of(method: str, message: bytes, rounds: int, warmup: int) -> list[float]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    parent, child = ctx.Pipe()
    shm = SharedMemory(create=True, size=SHM_BYTES) if method == "shm" else None
    event = ctx.Event()
    proc = ctx.Process(target=worker, args=(method, store.port, child, shm and shm.name, event, rounds + warmup),
                       daemon=True)
    proc.start()
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    torch.set_num_threads(1)
    layout_args = pickle.loads(message)  # what rank 0 pickles each step
    one, times = torch.zeros(1), []
    for i in range(rounds + warmup):
        start = time.perf_counter()
        data = pickle.dumps(layout_args, protocol=pickle.HIGHEST_PROTOCOL)
        if method == "pipe":
            parent.send_bytes(data)
        elif method == "shm":
            shm.buf[:8] = len(data).to_bytes(8, "little")
            shm.buf[8:8 + len(data)] = data
            event.set()
        elif method == "gloo":
            group.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
            group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()
        group.allreduce([one]).wait()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    proc.join()
    if shm is not None:
        shm.close()
        shm.unlink()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--methods", default="none,pipe,shm,gloo")
    args = parser.parse_args()
    messages = {"decode, batch 1": step_message(1, 0), "decode, batch 64": step_message(64, 0),
                "prefill, 2048 tokens": step_message(0, 2048)}
    print(f"{'step':22s} {'bytes':>7s} {'method':6s} {'median us':>10s} {'p10 us':>8s} {'p90 us':>8s} {'- none':>8s}")
    for name, message in messages.items():
        base = None
        for method in args.methods.split(","):
            times = sorted(rounds_of(method, message, args.rounds, warmup=100))
            median = statistics.median(times) * 1e6
            base = median if method == "none" else base
            extra = "" if base is None or method == "none" else f"{median - base:8.1f}"
            print(f"{name:22s} {len(message):7d} {method:6s} {median:10.1f} {times[len(times) // 10] * 1e6:8.1f} "
                  f"{times[9 * len(times) // 10] * 1e6:8.1f} {extra:>8s}", flush=True)


if __name__ == "__main__":
    main()
