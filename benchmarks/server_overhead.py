"""What the server costs over the engine (issue 36's targets), one workload, one run: `LLM.generate`
in this process, then `roseinfer serve` on the same model answering the same requests all at once,
non-streaming and streaming, from a light asyncio client (roseinfer/bench/http_client.py). For each: output tok/s, CPU µs per output
token (the offline process; the server's whole process tree; the client itself), and /health's p50 /
p99 polled beside the server runs.

With `--engine-process off,on` one server per mode (the engine core in a thread of the server, or in a
process of its own; both up at once, on --port and the ports after it), their runs alternating.

Usage: python benchmarks/server_overhead.py [--model DIR] [--num-requests 256] [--prompt-len 32]
       [--output-len 128] [--port 18700] [--rounds 1] [--engine-process off,on] [--serve-args "..."]
Without --model, a random tiny Llama (hidden 128, 3 layers, vocabulary 384 as the tests' tiny models) is
written to a temp folder.
Linux only (CPU time read from /proc).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from random_model import write_model  # beside this script

from roseinfer.bench.http_client import HTTPClient
from roseinfer.bench.metrics import percentile

TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """user + system seconds of `root` and its live descendants, all threads (from /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry)
        parents[pid], times[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += times.get(pid, 0.0)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return total


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Run:
    name: str
    tokens: int
    wall: float
    cpu: float  # the offline process, or the server's tree
    client_cpu: float | None = None
    health_ms: list[float] | None = None

    def line(self, offline: "Run | None") -> str:
        text = (f"{self.name:>20}: {self.tokens / self.wall:9.0f} output tok/s, {self.cpu / self.tokens * 1e6:6.1f} µs "
                f"CPU/token")
        if offline is not None:
            text += (f" ({self.tokens / self.wall / (offline.tokens / offline.wall):.2f}× offline tok/s, "
                     f"{self.cpu / self.tokens / (offline.cpu / offline.tokens):.2f}× offline CPU/token)")
        if self.client_cpu is not None:
            text += f"; client {self.client_cpu / self.tokens * 1e6:.1f} µs/token"
        if self.health_ms:
            text += (f"; /health p50 {percentile(self.health_ms, 50):.1f} ms, p99 {percentile(self.health_ms, 99):.1f} "
                     f"ms (n={len(self.health_ms)})")
        return text


def offline_run(model: str, prompts: list[list[int]], output_len: int) -> Run:
    from roseinfer import LLM, SamplingParams

    llm = LLM(model=model, max_num_seqs=len(prompts), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the first steps of each batch size are slower
    cpu, start = own_cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, own_cpu_seconds() - cpu
    llm.shutdown()
    return Run("offline", sum(len(o.token_ids) for o in outputs), wall, cpu)


def poll_health(port: int, out: list[float], stop: threading.Event) -> None:
    """/health every 50 ms from a thread of its own: what it measures is the server's answer, not this
    process's event loop."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    while not stop.is_set():
        start = time.perf_counter()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"/health answered {response.status}")
        out.append((time.perf_counter() - start) * 1000)
        stop.wait(0.05)
    connection.close()


async def one_request(client: HTTPClient, prompt: list[int], output_len: int, stream: bool) -> int:
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": stream}
    if not stream:
        reply = await client.post("/v1/completions", body)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    async with client.stream("/v1/completions", body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.read())[:500]!r}")
        async for line in reply.lines():
            if line.startswith(b'data: {"') and b'"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def all_at_once(base: str, prompts: list[list[int]], output_len: int, stream: bool) -> int:
    async with HTTPClient(base) as client:
        counts = await asyncio.gather(*(one_request(client, p, output_len, stream) for p in prompts))
    return sum(counts)


def server_run(name: str, port: int, server_pid: int, prompts: list[list[int]], output_len: int, stream: bool) -> Run:
    health: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(port, health, stop))
    cpu, client_cpu, start = tree_cpu_seconds(server_pid), own_cpu_seconds(), time.perf_counter()
    poller.start()
    tokens = asyncio.run(all_at_once(f"http://127.0.0.1:{port}", prompts, output_len, stream))
    wall = time.perf_counter() - start
    cpu, client_cpu = tree_cpu_seconds(server_pid) - cpu, own_cpu_seconds() - client_cpu
    stop.set()
    poller.join()
    return Run(name, tokens, wall, cpu, client_cpu, health)


def start_server(model: str, port: int, num_requests: int, extra: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "roseinfer.cli", "serve", "--model", model, "--port", str(port),
               "--max-num-seqs", str(num_requests), "--no-enable-prefix-caching", *extra]
    # its log to a file: a pipe nobody reads would fill and stall the server
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 600  # a guard against a hang, not a bound on start-up
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not answer /health within 600 s")
        connection = http.client.HTTPConnection("127.0.0.1", port)
        try:
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.5)
        finally:
            connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--rounds", type=int, default=1, help="server runs of each kind")
    parser.add_argument("--engine-process", default="off,on",
                        help="comma-separated --engine-process modes of the servers compared (auto, on, off)")
    parser.add_argument("--serve-args", default="", help="more `roseinfer serve` flags")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny-llama")
            write_model("tiny-llama", Path(model), dtype=torch.float32)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        print(f"{args.num_requests} requests × {args.prompt_len} prompt / {args.output_len} output tokens, all at "
              f"once; model {model}")
        offline = offline_run(model, prompts, args.output_len)
        print(offline.line(None), flush=True)
        servers: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            for i, mode in enumerate(args.engine_process.split(",")):
                port = args.port + i
                flags = ["--engine-process", mode, *shlex.split(args.serve_args)]
                server = start_server(model, port, args.num_requests, flags, Path(tmp) / f"serve-{mode}.log")
                servers[mode] = server, port
                asyncio.run(all_at_once(f"http://127.0.0.1:{port}", prompts, args.output_len, stream=True))  # warm-up
            for _ in range(args.rounds):
                for name, stream in (("non-streaming", False), ("streaming", True)):
                    for mode, (server, port) in servers.items():
                        run = server_run(f"{name} [{mode}]", port, server.pid, prompts, args.output_len, stream)
                        print(run.line(offline), flush=True)
        finally:
            for server, _ in servers.values():
                server.terminate()
            for server, _ in servers.values():
                server.wait(60)


if __name__ == "__main__":
    main()
