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
from typing import Any

import msgspec
from tqdm import tqdm

from .datasets import DATASETS, BenchRequest, Tokenizer, load_requests
from .http_client import HTTPClient, HTTPStatusError
from .metrics import parse_goodput
from .schedules import request_arrival_offsets
from .serve_report import ENDPOINTS, RequestResult, compute_summary, format_table, write_plot


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


async def _stream_one(client: HTTPClient, path: str, payload: dict[str, Any],
                      chat: bool, res: RequestResult) -> None:
    res.submit_start = time.perf_counter()
    async with client.stream(path, payload) as resp:
        if resp.status != 200:
            body = (await resp.read()).decode("utf-8", errors="replace")
            raise _ServerError(f"HTTP {resp.status}: {body[:500]}")
        async for line in resp.lines():
            # Stamp before parsing so JSON decoding does not count as latency.
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == b"[DONE]":
                continue  # the body ends here: read to its end, the connection is reused
            obj = msgspec.json.decode(data)
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


async def _run_one(client: HTTPClient, args: argparse.Namespace, model: str,
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


async def _first_model(client: HTTPClient, timeout: float) -> str:
    try:
        resp = await asyncio.wait_for(client.get("/v1/models"), timeout)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (OSError, EOFError, HTTPStatusError, ValueError, asyncio.TimeoutError) as e:  # down, wrong URL, not JSON
        raise RuntimeError(f"GET {client.base_url}/v1/models failed ({type(e).__name__}: {e}); "
                           "is the server up? (or pass --model)") from e
    if not data:
        raise RuntimeError("GET /v1/models returned no models; pass --model")
    return str(data[0]["id"])


async def _run(args: argparse.Namespace, requests: list[BenchRequest]
               ) -> tuple[str, list[RequestResult], float, float]:
    offsets = request_arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    limit = args.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    # asyncio.wait_for bounds each whole request, so --timeout means one thing however it runs out
    async with HTTPClient(args.base_url, headers) as client:
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
