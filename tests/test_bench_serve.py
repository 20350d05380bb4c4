"""``bench serve`` against a stub OpenAI-compatible server (uvicorn on a loopback port).

The stub waits FIRST_DELAY before the first chunk and GAP between chunks, so the
client's TTFT / ITL must land near those values; it fails prompts containing "FAIL"
and omits the usage chunk for prompts containing "NOUSAGE".
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from roseinfer.bench.serve import add_serve_args, main, run_serve_bench
from server_helpers import serve_app

FIRST_DELAY = 0.05
GAP = 0.02
MAX_CHUNKS = 4


class StubState:
    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0


state = StubState()
app = FastAPI()


@app.get("/v1/models")
async def models() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}


async def _sse(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    n = min(int(body["max_tokens"]), MAX_CHUNKS)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP)
            choice = ({"index": 0, "delta": {"content": f" tok{i}"}} if chat
                      else {"index": 0, "text": f" tok{i}"})
            yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        if "NOUSAGE" not in prompt:
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                     "total_tokens": len(prompt.split()) + n}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


async def _handle(request: Request, chat: bool) -> Any:
    body = await request.json()
    state.payloads.append(body)
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    if "FAIL" in prompt:
        return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
    return StreamingResponse(_sse(body, chat), media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await _handle(request, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    return await _handle(request, chat=True)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve_app(app) as url:
        yield url


@pytest.fixture(autouse=True)
def _reset_state() -> None:
    state.__init__()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--no-progress", *argv])


def test_completions_random_dataset_with_plot_and_json(base_url: str, tmp_path) -> None:
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    s = run_serve_bench(_args(
        "--base-url", base_url, "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
        "--goodput", "ttft:3600000", "tpot:3600000", "--json", str(json_path), "--plot", str(png_path)))
    assert s["model"] == "stub-model"  # discovered from GET /v1/models
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == 24 and s["total_input_tokens"] == 6 * 16
    assert s["duration_s"] > FIRST_DELAY + 3 * GAP * 0.9
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(24 / s["duration_s"])
    assert s["total_token_throughput"] == pytest.approx((24 + 96) / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # SLOs of an hour: all count
    # Latencies in ms: at least the stub's sleeps, and (however busy the machine) within the run
    assert FIRST_DELAY * 1000 * 0.9 <= s["ttft_ms"]["mean"] <= s["e2el_ms"]["mean"]
    assert s["itl_ms"]["count"] == 6 * 3
    assert GAP * 1000 * 0.5 <= s["itl_ms"]["median"] <= s["e2el_ms"]["max"] - s["ttft_ms"]["min"]
    assert GAP * 1000 * 0.5 <= s["tpot_ms"]["mean"] <= s["e2el_ms"]["max"]
    assert s["e2el_ms"]["min"] >= s["ttft_ms"]["min"] > 0
    assert s["e2el_ms"]["max"] <= s["duration_s"] * 1000
    # The request body is what an OpenAI-compatible server expects for streaming.
    p = state.payloads[0]
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["model"] == "stub-model" and p["max_tokens"] == 4 and "ignore_eos" not in p
    assert len(p["prompt"].split()) == 16
    # Files: the JSON round-trips with per-request records; the PNG is a real PNG.
    data = json.loads(json_path.read_text())
    assert data["completed"] == 6 and len(data["requests"]) == 6
    rec = data["requests"][0]
    assert rec["success"] and rec["output_tokens"] == 4 and len(rec["token_times_s"]) == 4
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000


def test_chat_jsonl_failures_concurrency_and_no_usage(base_url: str, tmp_path) -> None:
    ds = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "output_len": 3}, {"prompt": "please FAIL now"},
             {"prompt": "NOUSAGE here", "output_len": 2}, {"prompt": "last one"}]
    ds.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = run_serve_bench(_args(
        "--base-url", base_url, "--endpoint", "chat", "--model", "my-model",
        "--dataset-path", str(ds), "--num-prompts", "4", "--output-len", "4",
        "--max-concurrency", "2", "--request-rate", "200", "--burstiness", "2",
        "--ignore-eos", "--goodput", "ttft:1"))
    assert (s["completed"], s["failed"]) == (3, 1)
    failed = [r for r in s["requests"] if not r["success"]]
    assert failed[0]["index"] == 1
    assert "HTTP 500" in failed[0]["error"] and "stub failure" in failed[0]["error"]
    # NOUSAGE falls back to the chunk count (2); the others use usage (3 and 4).
    assert [r["output_tokens"] for r in s["requests"] if r["success"]] == [3, 2, 4]
    assert s["total_output_tokens"] == 9
    assert s["goodput"] == 0.0  # a 1 ms TTFT SLO cannot be met behind a 50 ms stub
    assert state.max_in_flight <= 2
    assert all(p["ignore_eos"] is True and p["model"] == "my-model" for p in state.payloads)
    assert all(p["messages"][0]["role"] == "user" for p in state.payloads)


def test_main_prints_table_and_rejects_bad_goodput(base_url: str, capsys) -> None:
    rc = main(["--base-url", base_url, "--num-prompts", "2", "--input-len", "8",
               "--output-len", "2", "--dataset", "shared-prefix", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    assert "Successful requests:" in out
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", base_url, "--goodput", "ttft=5"])
    assert exc.value.code == 2
    assert "KEY:MS" in capsys.readouterr().err


def test_timeout_marks_requests_failed(base_url: str) -> None:
    # The stub's first chunk comes after 50 ms, so a 10 ms budget must fail every request.
    s = run_serve_bench(_args("--base-url", base_url, "--num-prompts", "2", "--input-len", "4",
                              "--output-len", "2", "--timeout", "0.01", "--model", "m"))
    assert (s["completed"], s["failed"]) == (0, 2)
    assert all(r["error"] == "timed out after 0.01s" for r in s["requests"])
    assert s["ttft_ms"]["count"] == 0 and s["request_throughput"] == 0.0
