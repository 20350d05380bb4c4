"""``bench serve``'s report: what the client saw of each request (RequestResult), the summary of a run's per-request results (latencies in ms, throughput,
goodput, one record per request), its vLLM-style table and its plot."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .datasets import BenchRequest
from .metrics import RequestTiming, goodput, summarize

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """What the client saw of one request; times are perf_counter seconds."""

    index: int
    request: BenchRequest
    scheduled: float  # due offset from the benchmark start
    submit_start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    chunks_text: int = 0
    output_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None  # from the usage chunk
    success: bool = False
    error: str | None = None

    def timing(self) -> RequestTiming:
        # Over HTTP the submit is a single event: the request leaves the client.
        return RequestTiming(submit_start=self.submit_start, submit_end=self.submit_start,
                             token_times=self.token_times, end=self.end,
                             output_tokens=self.output_tokens)


# (summary key, table heading, short label) for each latency metric, in print order.
_LATENCY_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft_ms", "Time to First Token", "TTFT"),
    ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl_ms", "Inter-token Latency", "ITL"),
    ("e2el_ms", "End-to-end Latency", "E2EL"),
)


def _ms(values: list[float]) -> dict[str, float | int | None]:
    return summarize(v * 1000.0 for v in values)


def _record(res: RequestResult, t0: float) -> dict[str, Any]:
    t = res.timing()
    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000.0
    return {
        "index": res.index, "success": res.success, "error": res.error,
        "prompt_len": res.request.prompt_len, "prompt_tokens": res.prompt_tokens,
        "requested_output_len": res.request.output_len, "output_tokens": t.num_tokens,
        "text_chunks": res.chunks_text, "scheduled_s": res.scheduled,
        "start_s": res.submit_start - t0, "end_s": res.end - t0,
        "ttft_ms": ms(t.ttft) if res.success else None,
        "tpot_ms": ms(t.tpot) if res.success else None,
        "e2el_ms": ms(t.latency) if res.success else None,
        "token_times_s": [x - t0 for x in res.token_times],
    }


def compute_summary(args: argparse.Namespace, model: str, results: list[RequestResult],
                    t0: float, duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """All summary numbers (latencies in ms) plus one record per request."""
    ok = [r for r in results if r.success]
    timings = [r.timing() for r in ok]
    in_tok = sum(r.prompt_tokens if r.prompt_tokens is not None else (r.request.prompt_len or 0)
                 for r in ok)
    out_tok = sum(t.num_tokens for t in timings)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "base_url": args.base_url, "endpoint": ENDPOINTS[args.endpoint], "model": model,
        "dataset": args.dataset_path or args.dataset, "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tok),
        "total_token_throughput": per_s(in_tok + out_tok),
        "goodput_slo_ms": slo or None,
        "goodput": goodput(timings, slo, duration) if slo else None,
        "ttft_ms": _ms([t.ttft for t in timings if t.ttft is not None]),
        "tpot_ms": _ms([t.tpot for t in timings if t.tpot is not None]),
        "itl_ms": _ms([x for t in timings for x in t.itls]),
        "e2el_ms": _ms([t.latency for t in timings]),
        "requests": [_record(r, t0) for r in results],
    }


def format_table(s: dict[str, Any]) -> str:
    """The summary as a fixed-width table in the style of vLLM's benchmark_serving."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]
    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = "n/a" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
        lines.append(f"{label:<40}{text:>10}" if len(text) <= 10 else f"{label:<40}{text}")
    row("Endpoint:", f"POST {s['endpoint']}")
    row("Model:", s["model"])
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    if s["goodput_slo_ms"]:
        row("Request goodput (req/s):", s["goodput"])
    for key, heading, label in _LATENCY_SECTIONS:
        lines.append(f" {heading} ".center(width, "-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            row(f"{name} {label} (ms):", s[key][stat])
    lines.append("=" * width)
    errors = [r for r in s["requests"] if not r["success"]]
    for r in errors[:5]:  # enough to diagnose; the JSON keeps them all
        lines.append(f"request {r['index']} failed: {r['error']}")
    if len(errors) > 5:
        lines.append(f"... and {len(errors) - 5} more failures (see --json)")
    return "\n".join(lines)


def write_plot(path: str | Path, summary: dict[str, Any]) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) and a per-second output-token throughput timeline."""
    # Figure + the Agg canvas directly: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in summary["requests"] if r["success"]]
    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for ax, key, title in ((axes[0, 0], "ttft_ms", "TTFT"), (axes[0, 1], "tpot_ms", "TPOT"),
                           (axes[1, 0], "e2el_ms", "End-to-end latency")):
        vals = np.sort([r[key] for r in ok if r[key] is not None])
        if vals.size:
            ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    # Spread each request's token count over its text chunks, so servers that coalesce
    # tokens into fewer chunks still plot the right tokens/s.
    times: list[float] = []
    weights: list[float] = []
    for r in ok:
        if r["token_times_s"]:
            w = r["output_tokens"] / len(r["token_times_s"])
            times += r["token_times_s"]
            weights += [w] * len(r["token_times_s"])
    # 1 s bins, the last one cut at the benchmark's end and divided by its real width,
    # so a partial final second does not read as a throughput drop.
    duration = max(summary["duration_s"], 1e-9)
    edges = np.append(np.arange(0.0, duration, 1.0), duration)
    counts, _ = np.histogram(times, bins=edges, weights=weights or None)
    ax = axes[1, 1]
    ax.bar(edges[:-1], counts / np.diff(edges), width=np.diff(edges), align="edge")
    ax.set(title="Output token throughput", xlabel="seconds since start", ylabel="tokens/s (1 s bins)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"bench serve: {summary['model']} {summary['endpoint']}, "
                 f"{summary['completed']}/{summary['num_prompts']} ok")
    fig.savefig(path, dpi=100)
