"""``bench streaming``: the blog's benchmark_streaming, in process.

Requests go through ``InProcessClient``, the engine loop the HTTP server runs, so the
numbers include everything but HTTP: submission, tokenization, queueing, the engine's
steps and the delivery of each delta to a consumer. Consumers are client threads (one per
stream, or one asyncio collector thread with ``--consumer collector``), and every token
time is stamped where the consumer receives its delta.

Per request (seconds on one perf_counter clock, printed as ms percentiles):

* Submit lag = actual submit start - scheduled time (absolute / poisson schedules, interval > 0)
* add_request latency = how long ``InProcessClient.submit`` took; reject latency = the same
  for the submissions it refused (``--max-inflight-requests``)
* Tokenize = time to encode the prompt (measured before the run with ``--pretok``)
* Queue wait (post-tok) = admitted - max(submit end, tokenized); submit end is when the manager
  queued the request (the client's submit() may return after the worker admitted it)
* Prefill->first token = first token - admitted
* TTFT = first token - submit start; TPOT = (last - first) / (n - 1)
* ITL = every gap between consecutive deltas, pooled; Latency = stream end - submit start

Throughput divides completion tokens (and, with ``--detailed``, prompt + completion tokens) by
the wall time from the first submission to the last stream's end.

The lines printed are the blog's, character for character but the numbers: a
``=== warmup i/n ===`` marker before each warmup run, ``=== run i/n ===`` before each measured
run when there are several, then one ``=== streaming benchmark ===`` block per measured run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from roseinfer.loader.default_model import DEFAULT_MODEL_NAME
from roseinfer.sampling_params import SamplingParams

from .engine_flags import (add_engine_flags, add_sampling_flags, engine_config_from_flags, nvtx_range,
                           sampling_params_from_flags)
from .metrics import format_p50_p95_p99
from .schedules import SCHEDULES, next_submit_time, submit_lags, submit_offsets
from .stream_consumers import CONSUMERS, StreamRecord, make_consumer


@dataclass
class RunReport:
    records: list[StreamRecord]
    wall_s: float
    submit_wall_s: float
    submit_lags_s: list[float] | None

    @property
    def ok(self) -> list[StreamRecord]:
        return [r for r in self.records if r.error is None]

    def throughput(self) -> tuple[float, float]:
        completion = sum(r.num_tokens for r in self.ok)
        prompt = sum(r.prompt_tokens for r in self.ok)
        if self.wall_s <= 0:
            return 0.0, 0.0
        return completion / self.wall_s, (prompt + completion) / self.wall_s


def build_prompts(args: argparse.Namespace, run_index: int) -> list[str]:
    """Prompt i is --prompt repeated r_i times (r cycles through --prompt-repeats). With
    --unique-prompts a run-and-request tag leads each prompt, so no two share a prefix
    block, within a run or across runs."""
    repeats = args.prompt_repeats or [1]
    prompts = []
    for i in range(args.num_requests):
        text = " ".join([args.prompt] * repeats[i % len(repeats)])
        prompts.append(f"[{run_index}.{i}] {text}" if args.unique_prompts else text)
    return prompts


class _Submitter:
    """Tokenizes (unless pre-tokenized), then has the consumer submit and read the stream."""

    def __init__(self, manager: Any, tokenizer: Any, params: SamplingParams, consumer: Any,
                 overloaded: type[Exception], run_tag: str, pretok: list[tuple[list[int], float]] | None) -> None:
        self.manager, self.tokenizer, self.params = manager, tokenizer, params
        self.consumer, self.overloaded, self.run_tag, self.pretok = consumer, overloaded, run_tag, pretok

    def __call__(self, rec: StreamRecord, prompt: str) -> None:
        if self.pretok is not None:
            ids, rec.tokenize_s = self.pretok[rec.index]
        else:
            t = time.perf_counter()
            ids = self.tokenizer.encode(prompt)
            rec.tokenized = time.perf_counter()
            rec.tokenize_s = rec.tokenized - t
        rec.prompt_tokens = len(ids)
        self.consumer.start(rec, lambda: self._submit(rec, ids))

    def _submit(self, rec: StreamRecord, ids: list[int]) -> Any:
        call = time.perf_counter()
        try:
            return self.manager.submit(ids, self.params, request_id=f"{self.run_tag}-{rec.index}",
                                       submit_start=rec.submit_start)
        except self.overloaded:
            rec.error = "rejected"
        except ValueError as exc:
            rec.error = str(exc)
        finally:
            rec.submit_end = time.perf_counter()
            rec.submit_call_s = rec.submit_end - call
        return None


def run_once(args: argparse.Namespace, engine: Any, run_index: int) -> RunReport:
    from roseinfer.engine_client.client import OverloadedError
    from roseinfer.engine_client.in_process import InProcessClient

    prompts = build_prompts(args, run_index)
    pretok = None
    if args.pretok:
        pretok = []
        for text in prompts:
            t = time.perf_counter()
            pretok.append((engine.tokenizer.encode(text), time.perf_counter() - t))
    interval = args.submit_interval_ms / 1000.0
    offsets = submit_offsets(len(prompts), interval, args.submit_schedule, args.seed + run_index)
    manager = InProcessClient(engine, stream_interval=args.stream_interval,
                               max_inflight_requests=args.max_inflight_requests)
    consumer = make_consumer(args.consumer, timeout=args.request_timeout, abort=manager.abort)
    submit = _Submitter(manager, engine.tokenizer, sampling_params_from_flags(args), consumer, OverloadedError,
                        f"bench{run_index}", pretok)
    pool = ThreadPoolExecutor(args.tokenize_workers) if args.tokenize_workers else None
    records: list[StreamRecord] = []
    pending = []  # the pool's futures, so that a worker's exception is raised here
    manager.start()
    try:
        t0 = time.perf_counter()
        last_end = None
        for i, text in enumerate(prompts):
            due = next_submit_time(i, t0, interval, offsets, last_end)
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            rec = StreamRecord(index=i, submit_start=time.perf_counter())
            records.append(rec)
            if pool is not None:
                pending.append(pool.submit(submit, rec, text))
            else:
                submit(rec, text)
            last_end = time.perf_counter()
        for future in pending:
            future.result()
        consumer.join()
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        consumer.close()
        manager.shutdown()
    ends = [r.end for r in records if r.end is not None]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    submit_ends = [r.submit_end for r in records if r.submit_end is not None]
    lags = submit_lags([r.submit_start for r in records], t0, offsets)
    return RunReport(records, wall, max(submit_ends, default=t0) - t0, lags)


def format_report(args: argparse.Namespace, reports: list[RunReport], title: str = "streaming benchmark") -> str:
    """The blog's block of lines. Several reports are pooled (percentiles over all their requests,
    throughput and submit wall averaged), for --detailed's summary over the repeat runs."""
    records = [r for rep in reports for r in rep.records]
    rejected = [r for r in records if r.error == "rejected"]
    failed = [r for r in records if r.error not in (None, "rejected")]
    ok = [r for r in records if r.error is None]
    timings = [r.timing() for r in ok]
    comp, total = (statistics.fmean(x) for x in zip(*(rep.throughput() for rep in reports)))
    lines = [
        f"=== {title} ===",
        f"Model: {args.model or DEFAULT_MODEL_NAME}",
        f"Device: {args.device}",
        f"Pretok: {args.pretok}",
        f"Tokenize workers: {args.tokenize_workers}",
        f"Stream interval: {args.stream_interval}",
        f"Paged attention: {args.paged_attn}",
        f"CUDA Graph: {args.cuda_graph}",
        f"NVTX: {args.nvtx}",
        f"Requests: {len(records) - len(rejected)}",
    ]
    if args.max_inflight_requests is not None:
        lines.append(f"Rejected: {len(rejected)}")
    if failed:  # never silent; a blog run has none, so its lines stay the blog's
        lines.append(f"Failed: {len(failed)} (first error: {failed[0].error})")
    lines += [
        f"Prompt tokens (total): {sum(r.prompt_tokens for r in ok)}",
        f"Completion tokens (total): {sum(r.num_tokens for r in ok)}",
        f"Submit wall: {statistics.fmean(rep.submit_wall_s for rep in reports):.6f} s",
    ]
    if args.submit_interval_ms > 0:
        lines.append(f"Submit interval/schedule: {args.submit_interval_ms:.3f} ms / {args.submit_schedule}")
        if args.submit_schedule != "relative":
            lines.append(format_p50_p95_p99("Submit lag", [x for rep in reports for x in rep.submit_lags_s or []]))
    lines.append(format_p50_p95_p99("add_request latency",
                                    [r.submit_call_s for r in ok if r.submit_call_s is not None]))
    if args.max_inflight_requests is not None:
        lines.append(format_p50_p95_p99("reject latency",
                                        [r.submit_call_s for r in rejected if r.submit_call_s is not None]))
    lines += [
        format_p50_p95_p99("Tokenize", [r.tokenize_s for r in ok if r.tokenize_s is not None]),
        format_p50_p95_p99("Queue wait (post-tok)", [t.queue_wait for t in timings if t.queue_wait is not None]),
        format_p50_p95_p99("Prefill->first token",
                           [t.prefill_to_first_token for t in timings if t.prefill_to_first_token is not None]),
        format_p50_p95_p99("TTFT", [t.ttft for t in timings if t.ttft is not None]),
        format_p50_p95_p99("TPOT", [t.tpot for t in timings if t.tpot is not None], "ms/token"),
        format_p50_p95_p99("ITL", [x for t in timings for x in t.itls]),
        format_p50_p95_p99("Latency", [t.latency for t in timings]),
        f"Throughput (completion,total): {comp:.2f} tokens/s",
    ]
    if args.detailed:
        lines.append(f"Throughput (total,total): {total:.2f} tokens/s")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected a comma list of positive integers, e.g. 1,4,16")
    return values


def add_streaming_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("workload")
    p.add_argument("--prompt", default="Hello", help="prompt text (default: Hello)")
    p.add_argument("--prompt-repeats", type=_int_list, default=None, metavar="R1,R2,...",
                   help="prompt i is the prompt repeated r_i times, cycling through the list")
    p.add_argument("--unique-prompts", action="store_true",
                   help="tag each prompt with its run and request index so no two share a prefix")
    p.add_argument("--num-requests", type=int, default=16, help="requests per run (default: %(default)s)")
    p.add_argument("--submit-interval-ms", type=float, default=0.0, help="gap between submissions (default: 0)")
    p.add_argument("--submit-schedule", choices=SCHEDULES, default="relative",
                   help="relative: sleep the interval after each submit; absolute: request i at t0 + i*interval; "
                        "poisson: exponential gaps of that mean, seeded by --seed")
    p.add_argument("--pretok", action="store_true", help="tokenize every prompt before the timed run")
    p.add_argument("--tokenize-workers", type=int, default=0,
                   help="tokenize and submit from a pool of N threads instead of the submitting loop")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed delta (default: 1)")
    p.add_argument("--max-inflight-requests", type=int, default=None,
                   help="InProcessClient rejects submissions beyond this many in flight")
    p.add_argument("--consumer", choices=CONSUMERS, default="threads",
                   help="threads: one client thread per stream (default); collector: one asyncio thread")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a stalled request is counted as failed and aborted (default: %(default)s)")
    p.add_argument("--warmup-runs", type=int, default=0,
                   help="unreported runs first: JIT, allocator, caches (default: %(default)s)")
    p.add_argument("--repeat-runs", type=int, default=1, help="measured runs (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run's per-request records as JSON")
    p.add_argument("--detailed", action="store_true",
                   help="beyond the blog's lines: Throughput (total,total), prompt + completion tokens/s, in "
                        "each block, and with several --repeat-runs a summary pooled over them")
    add_sampling_flags(parser)
    add_engine_flags(parser)


def run_streaming_bench(args: argparse.Namespace) -> dict[str, Any]:
    from roseinfer.engine.llm_engine import LLMEngine

    if args.num_requests < 1 or args.warmup_runs < 0 or args.repeat_runs < 1:
        raise ValueError("--num-requests and --repeat-runs must be >= 1, --warmup-runs >= 0")
    if args.pretok and args.tokenize_workers:
        raise ValueError("--pretok and --tokenize-workers exclude each other")
    engine = LLMEngine(engine_config_from_flags(args))
    reports: list[RunReport] = []
    for k in range(args.warmup_runs + args.repeat_runs):
        measured = k - args.warmup_runs
        # the blog's markers: every warmup run is announced, measured runs only when there are several
        if measured < 0:
            print(f"=== warmup {k + 1}/{args.warmup_runs} ===", flush=True)
        elif args.repeat_runs > 1:
            print(f"=== run {measured + 1}/{args.repeat_runs} ===", flush=True)
        with nvtx_range(args, f"streaming/run{k}"):
            report = run_once(args, engine, k)
        if measured < 0:
            continue  # warmup runs are neither reported nor summarized
        reports.append(report)
        print(format_report(args, [report]), flush=True)
    if args.detailed and len(reports) > 1:
        print(format_report(args, reports, f"streaming benchmark (summary over {len(reports)} runs)"), flush=True)
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"},
              "runs": [{"completed": len(rep.ok), "wall_s": rep.wall_s, "submit_wall_s": rep.submit_wall_s,
                        "throughput_completion": rep.throughput()[0], "throughput_total": rep.throughput()[1],
                        "submit_lags_s": rep.submit_lags_s, "requests": [asdict(r) for r in rep.records]}
                       for rep in reports]}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result
