"""``roseinfer bench {streaming,offline,throughput,serve}``: the benchmark subcommands.

Each subcommand is registered here once, for both ways of calling it: under the main
``roseinfer`` CLI (``add_bench_parser``) and as the blog's stand-alone modules
(``python -m roseinfer.benchmark_streaming`` / ``benchmark_scheduler``, via ``main``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from . import offline, offline_args, serve, streaming, throughput


@dataclass(frozen=True)
class Subcommand:
    help: str
    description: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _run_streaming(args: argparse.Namespace) -> int:
    result = streaming.run_streaming_bench(args)
    # a run in which no request completed measured nothing: say so in the exit status
    return 0 if all(run["completed"] > 0 for run in result["runs"]) else 1


def _run_offline(args: argparse.Namespace) -> int:
    offline.run_offline_bench(args)
    return 0


def _run_throughput(args: argparse.Namespace) -> int:
    throughput.run_throughput_bench(args)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    try:
        summary = serve.run_serve_bench(args)
    except RuntimeError as exc:  # the server could not be reached or named no model
        print(f"roseinfer bench serve: {exc}", file=sys.stderr)
        return 1
    return 0 if summary["completed"] > 0 else 1


SUBCOMMANDS: dict[str, Subcommand] = {
    "streaming": Subcommand(
        help="in-process streaming latency (TTFT/TPOT/ITL) through the server's engine loop",
        description="Submit requests on a schedule to the engine loop the server uses (InProcessClient), "
                    "consume every stream as a client would, and report submit lag, tokenize, queue wait, "
                    "prefill, TTFT, TPOT, ITL and latency percentiles plus throughput. "
                    "Same as `python -m roseinfer.benchmark_streaming`.",
        add_args=streaming.add_streaming_args, run=_run_streaming),
    "offline": Subcommand(
        help="batch throughput: naive / offline (LLM.generate) / online, optionally vs HF transformers",
        description="Run the same prompts one at a time (naive), all at once through LLM.generate (offline) "
                    "or all at once stepping the engine by hand (online), and report prefill/decode/total "
                    "time and throughput; --backend hf runs transformers' generate for comparison. "
                    "Same as `python -m roseinfer.benchmark_scheduler`.",
        add_args=offline_args.add_offline_args, run=_run_offline),
    "throughput": Subcommand(
        help="offline throughput on nano-vllm's workload (random prompts and lengths), optionally vs HF",
        description=throughput.__doc__.split("\n\n")[0].replace("``", "`"),
        add_args=throughput.add_throughput_args, run=_run_throughput),
    "serve": Subcommand(
        help="load-test a running OpenAI-compatible server over HTTP (vLLM's benchmark_serving)",
        description=serve.__doc__.split("\n\n")[0].replace("``", "`"),
        add_args=serve.add_serve_args, run=_run_serve),
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: streaming, offline, throughput, serve",
        description="Benchmarks. `roseinfer bench COMMAND --help` lists a benchmark's flags.")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description)
        cmd.add_args(p)
        p.set_defaults(func=cmd.run)


def main(name: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run one bench subcommand stand-alone (the ``python -m`` entry points)."""
    cmd = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=prog or f"roseinfer bench {name}", description=cmd.description)
    cmd.add_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd.run(args)
    except (ValueError, OSError) as exc:  # bad input, unreadable model: one line, no traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
