"""Where the API process of `roseinfer serve` spends its CPU per token: the server run under cProfile
with each thread's own CPU clock (time.thread_time, so waiting for the GIL counts nowhere), the event
loop (main thread) and the engine client's output thread profiled apart, while server_overhead.py's
load (256 requests × 32 / 128 tokens at once) runs against it. The engine core is in its own
process (--engine-process on) and is not profiled here.

Usage: python benchmarks/server_profile.py [--stream] [--rounds 2] [--top 30] [--port 18700]
Writes loop.prof and outputs.prof to --out (pstats files) and prints the top functions of each. The
loop's profile covers the server's whole life, start-up (imports, building the app) included: read
its per-function rows, and its total over more rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import http.client
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROFILE_DIR_ENV = "ROSEINFER_SERVER_PROFILE_DIR"


def profiled_serve(argv: list[str]) -> None:
    """`roseinfer serve argv`, profiled; the profiles written when it exits."""
    from roseinfer.engine_client.process_client import EngineProcessClient
    from roseinfer.cli import main

    out = Path(os.environ[PROFILE_DIR_ENV])
    outputs, loop = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)
    run_outputs = EngineProcessClient._run

    def profiled_run(client: EngineProcessClient) -> None:
        outputs.enable()
        try:
            run_outputs(client)
        finally:
            outputs.disable()

    EngineProcessClient._run = profiled_run  # type: ignore[method-assign]
    loop.enable()
    try:
        main(["serve", *argv])
    finally:
        loop.disable()
        loop.dump_stats(out / "loop.prof")
        outputs.dump_stats(out / "outputs.prof")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", action="store_true", help="streaming requests (default: non-streaming)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--out", default=None, help="folder for the .prof files (default: a temp folder)")
    args = parser.parse_args()
    from random_model import write_model  # beside this script
    from server_overhead import all_at_once, tree_cpu_seconds

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = Path(tmp) / "tiny-llama"
        write_model("tiny-llama", model, dtype=torch.float32)
        rng = random.Random(0)
        prompts = [[rng.randrange(1, 384) for _ in range(32)] for _ in range(256)]
        command = [sys.executable, __file__, "--serve", "--model", str(model), "--port", str(args.port),
                   "--max-num-seqs", "256", "--no-enable-prefix-caching", "--engine-process", "on"]
        log = out / "serve.log"
        server = subprocess.Popen(command, env={**os.environ, PROFILE_DIR_ENV: str(out)}, stdout=subprocess.DEVNULL,
                                  stderr=log.open("w"))
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
            connection = http.client.HTTPConnection("127.0.0.1", args.port)
            try:
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            finally:
                connection.close()
        tokens = 0
        for _ in range(args.rounds):
            cpu, start = tree_cpu_seconds(server.pid), time.perf_counter()
            count = asyncio.run(all_at_once(f"http://127.0.0.1:{args.port}", prompts, 128, args.stream))
            wall, cpu = time.perf_counter() - start, tree_cpu_seconds(server.pid) - cpu
            tokens += count
            print(f"{count / wall:.0f} output tok/s, server {cpu / count * 1e6:.1f} µs CPU/token (profiled)")
        server.terminate()
        server.wait(60)
        for name in ("loop", "outputs"):
            stats = pstats.Stats(str(out / f"{name}.prof"))
            print(f"===== {name}: {stats.total_tt / tokens * 1e6:.1f} µs of the thread's CPU per token (profiled)")
            stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        profiled_serve(sys.argv[2:])
    else:
        main()
