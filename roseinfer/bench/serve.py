"""``bench serve``: a streaming load generator for any OpenAI-compatible server.

Modelled on vLLM's ``benchmark_serving``: requests arrive on a gamma process
(``--request-rate``, ``--burstiness``), optionally capped by ``--max-concurrency``;
each one streams over SSE and the client stamps the arrival of every chunk carrying
text. From those stamps come TTFT, TPOT, ITL and end-to-end latency; token counts come
from the final usage chunk (``stream_options.include_usage``), falling back to the
number of text chunks for servers that send no usage.

Run it as ``python -m roseinfer.bench.serve --base-url http://127.0.0.1:8000 ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from .datasets import DATASETS, BenchRequest, Tokenizer, load_requests
from .metrics import RequestTiming, goodput, parse_goodput, summarize
from .schedules import request_arrival_offsets

if TYPE_CHECKING:
    import httpx

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# (summary key, table heading, short label) for each latency metric, in print order.
_LATENCY_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft_ms", "Time to First Token", "TTFT"),
    ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl_ms", "Inter-token Latency", "ITL"),
    ("e2el_ms", "End-to-end Latency", "E2EL"),
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench serve`` flags on ``parser``."""
    p = parser
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions: POST /v1/completions; chat: POST /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' when given")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests/s; inf (default) sends all requests at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (later arrivals wait)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None,
                   help='JSONL file, one {"prompt": ..., "output_len": optional} per line')
    p.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens (random) or shared-prefix tokens (shared-prefix)")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (shared-prefix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--json", default=None, metavar="PATH", help="write summary + per-request records")
    p.add_argument("--plot", default=None, metavar="PNG", help="write latency CDFs + throughput timeline")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


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


class _ServerError(Exception):
    """An HTTP error status or an error event inside the stream."""


def _build_payload(args: argparse.Namespace, model: str, req: BenchRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    parts: list[str] = []
    for choice in obj.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            # Reasoning models stream thoughts separately; they are output tokens too.
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def _stream_one(client: httpx.AsyncClient, path: str, payload: dict[str, Any],
                      chat: bool, res: RequestResult) -> None:
    res.submit_start = time.perf_counter()
    async with client.stream("POST", path, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", errors="replace")
            raise _ServerError(f"HTTP {resp.status_code}: {body[:500]}")
        async for line in resp.aiter_lines():
            # Stamp before parsing so JSON decoding does not count as latency.
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                raise _ServerError(f"error in stream: {json.dumps(obj['error'])[:500]}")
            if _chunk_text(obj, chat):
                res.token_times.append(now)
                res.chunks_text += 1
            usage = obj.get("usage")
            if usage:
                res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
    res.end = time.perf_counter()
    res.success = True


async def _run_one(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                   res: RequestResult) -> None:
    chat = args.endpoint == "chat"
    payload = _build_payload(args, model, res.request)
    try:
        await asyncio.wait_for(_stream_one(client, ENDPOINTS[args.endpoint], payload, chat, res),
                               timeout=args.timeout)
    except asyncio.TimeoutError:
        res.error = f"timed out after {args.timeout:g}s"
    except Exception as e:  # one failed request must not end the benchmark
        res.error = f"{type(e).__name__}: {e}" if str(e) else repr(e)
    if not res.success:
        res.end = time.perf_counter()


async def _first_model(client: httpx.AsyncClient, timeout: float) -> str:
    import httpx

    try:
        resp = await asyncio.wait_for(client.get("/v1/models"), timeout)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as e:  # down, wrong URL, not JSON
        raise RuntimeError(f"GET {client.base_url}/v1/models failed ({type(e).__name__}: {e}); "
                           "is the server up? (or pass --model)") from e
    if not data:
        raise RuntimeError("GET /v1/models returned no models; pass --model")
    return str(data[0]["id"])


def _is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


async def _run(args: argparse.Namespace, requests: list[BenchRequest]
               ) -> tuple[str, list[RequestResult], float, float]:
    # imported here: httpx brings click, rich and pygments (~8 MiB resident), and every `roseinfer`
    # command builds this module's parser
    import httpx

    offsets = request_arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    limit = args.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"), headers=headers,
        # No per-operation limits: asyncio.wait_for bounds each whole request instead,
        # so --timeout means one thing (and one error message) however it runs out.
        timeout=httpx.Timeout(None),
        # The default pool (100) would silently cap concurrency; the cap is ours to set.
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        # An HTTP(S)_PROXY from the environment must not sit between us and a local server.
        trust_env=not _is_loopback(args.base_url),
    ) as client:
        model = args.model or await _first_model(client, args.timeout)
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", file=sys.stderr,
                   disable=args.no_progress or not sys.stderr.isatty())
        t0 = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> RequestResult:
            res = RequestResult(index=i, request=req, scheduled=offsets[i])
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await _run_one(client, args, model, res)
            else:
                async with sem:
                    await _run_one(client, args, model, res)
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
        bar.close()
    return model, list(results), t0, duration


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


def run_serve_bench(args: argparse.Namespace, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (from ``add_serve_args``); print the table,
    write --json / --plot, and return the summary dict (with per-request records).
    ``tokenizer`` (anything with ``encode``) sizes the generated prompts exactly."""
    slo = parse_goodput(args.goodput)
    requests = load_requests(args.dataset, args.num_prompts, args.input_len, args.output_len,
                             args.range_ratio, args.seed, args.dataset_path, tokenizer, args.num_prefixes)
    model, results, t0, duration = asyncio.run(_run(args, requests))
    summary = compute_summary(args, model, results, t0, duration, slo)
    print(format_table(summary), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        write_plot(args.plot, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roseinfer bench serve", description=__doc__.split("\n\n")[0])
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        summary = run_serve_bench(args)
    except ValueError as e:  # bad --goodput / dataset input: a usage error, not a crash
        parser.error(str(e))
    except RuntimeError as e:  # model discovery failed: say why, without a traceback
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    return 0 if summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
