"""``roseinfer bench streaming`` (the blog's benchmark_streaming) end to end on the tiny llama
checkpoint, through the real InProcessClient: the blog's lines (golden, numbers masked) and
flags, every submit schedule, both consumers, tokenize workers, rejections, --json, --detailed
and warmup exclusion."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from blog_golden import STREAMING, STREAMING_INFLIGHT, mask

from roseinfer.cli import main

N, NEW = 8, 6
METRICS = ("add_request latency", "Tokenize", "Queue wait (post-tok)", "Prefill->first token", "TTFT", "TPOT",
           "ITL", "Latency")
SWITCHES = ("Model", "Device", "Pretok", "Tokenize workers", "Stream interval", "Paged attention", "CUDA Graph",
            "NVTX")


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


@pytest.fixture(scope="module")
def blog_flags(tiny_model_factory) -> list[str]:
    """The blog's command line, scaled down; one torch thread because tiny matmuls on a
    small shared CPU are far slower split over two."""
    return ["--hf-model-id", str(tiny_model_factory("llama")), "--device", "cpu", "--prompt", "Hello",
            "--unique-prompts", "--num-requests", str(N), "--max-new-tokens", str(NEW), "--max-batch-size", "4",
            "--prefill-max-batch-size", "2", "--no-stop-on-eos", "--no-prefix-cache", "--num-threads", "1"]


def _p50s(text: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for name, p50, p95, p99 in re.findall(r"^(.+) p50/p95/p99: ([0-9.]+)/([0-9.]+)/([0-9.]+) ms(?:/token)?$",
                                          text, flags=re.M):
        assert float(p50) <= float(p95) <= float(p99)
        found.setdefault(name, []).append(float(p50))
    return found


def _check_requests(requests: list[dict], new_tokens: int = NEW) -> None:
    for r in requests:
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["num_tokens"] == new_tokens
        first, last = r["token_times"][0], r["token_times"][-1]
        ready = max(r["enqueued"], r["tokenized"] or r["enqueued"])
        assert r["submit_start"] <= ready <= r["admitted"] <= first <= last <= r["end"]
        # TTFT = queue wait + prefill + what came before the request was ready (tokenize, submit)
        ttft, queue, prefill = first - r["submit_start"], r["admitted"] - ready, first - r["admitted"]
        assert ttft >= queue + prefill - 1e-9


@pytest.mark.parametrize("schedule", ["relative", "absolute", "poisson"])
def test_blog_command_line_each_schedule(blog_flags: list[str], schedule: str, tmp_path, capsys) -> None:
    out_json = tmp_path / "s.json"
    rc = main(["bench", "streaming", *blog_flags, "--submit-interval-ms", "1", "--submit-schedule", schedule,
               "--warmup-runs", "1", "--repeat-runs", "2", "--detailed", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0
    # warmup announced but not reported: two measured runs, then --detailed's summary over both
    titles = re.findall(r"^=== (.+) ===$", text, flags=re.M)
    assert titles == ["warmup 1/1", "run 1/2", "streaming benchmark", "run 2/2", "streaming benchmark",
                      "streaming benchmark (summary over 2 runs)"]
    first_block = text.split("=== run 2/2 ===")[0].split("=== streaming benchmark ===")[1]
    labels = re.findall(r"^([^:\n]+):", first_block, flags=re.M)
    lag = ["Submit lag"] if schedule != "relative" else []
    assert labels == [*SWITCHES, "Requests", "Prompt tokens (total)", "Completion tokens (total)", "Submit wall",
                      "Submit interval/schedule", *(f"{m} p50/p95/p99" for m in (*lag, *METRICS)),
                      "Throughput (completion,total)", "Throughput (total,total)"]
    assert re.findall(r"^Requests: (\d+)$", text, flags=re.M) == [str(N), str(N), str(2 * N)]
    assert re.findall(r"^Completion tokens \(total\): (\d+)$", text, flags=re.M) == [str(N * NEW)] * 2 + [
        str(2 * N * NEW)]
    assert f"Submit interval/schedule: 1.000 ms / {schedule}" in text
    p50 = _p50s(text)
    assert set(p50) == set(METRICS) | set(lag)
    assert all(len(v) == 3 for v in p50.values())
    for i in range(3):
        assert p50["TTFT"][i] <= p50["Latency"][i]
        # 0 is possible: a client thread starved by a loaded machine stamps a request's queued deltas together
        assert 0 <= p50["TPOT"][i] <= p50["Latency"][i]
    completion = [float(x) for x in re.findall(r"^Throughput \(completion,total\): ([0-9.]+) tokens/s$", text,
                                               flags=re.M)]
    total = [float(x) for x in re.findall(r"^Throughput \(total,total\): ([0-9.]+) tokens/s$", text, flags=re.M)]
    assert len(completion) == len(total) == 3 and all(0 < c < t for c, t in zip(completion, total))
    # the summary's throughput is the mean of the runs'
    assert completion[2] == pytest.approx((completion[0] + completion[1]) / 2, abs=0.011)

    report = json.loads(out_json.read_text())
    assert report["args"]["submit_schedule"] == schedule and len(report["runs"]) == 2
    for run in report["runs"]:
        assert len(run["requests"]) == N
        _check_requests(run["requests"])
        # one delta per token at --stream-interval 1
        assert all(len(r["token_times"]) == NEW for r in run["requests"])
        assert run["throughput_completion"] == pytest.approx(N * NEW / run["wall_s"])
        if schedule == "relative":
            assert run["submit_lags_s"] is None
        else:
            assert len(run["submit_lags_s"]) == N and min(run["submit_lags_s"]) >= 0
    # --unique-prompts tags every prompt with run and index: distinct prompts, distinct lengths allowed
    prompt_tokens = [r["prompt_tokens"] for run in report["runs"] for r in run["requests"]]
    assert min(prompt_tokens) > 1


def test_collector_tokenize_workers_stream_interval(blog_flags: list[str], tmp_path, capsys) -> None:
    out_json = tmp_path / "c.json"
    rc = main(["bench", "streaming", *blog_flags, "--consumer", "collector", "--tokenize-workers", "2",
                                  "--stream-interval", "4", "--prompt-repeats", "1,3", "--json", str(out_json)])
    assert rc == 0
    assert f"Completion tokens (total): {N * NEW}" in capsys.readouterr().out
    requests = json.loads(out_json.read_text())["runs"][0]["requests"]
    _check_requests(requests)
    # first token flushed at once, then every 4: 6 tokens arrive in 1 + 4 + 1 -> 3 deltas
    assert all(len(r["token_times"]) == 3 for r in requests)
    short, long = requests[0]["prompt_tokens"], requests[1]["prompt_tokens"]
    assert long > short  # "Hello" repeated 3 times vs once


def test_pretok_and_rejections(blog_flags: list[str], tmp_path, capsys) -> None:
    out_json = tmp_path / "r.json"
    # 200 tokens each (near the tiny model's context) keep the first requests in flight far
    # longer than the burst takes, even when the submitting thread waits for the GIL
    rc = main(["bench", "streaming", *blog_flags, "--max-new-tokens", "200", "--pretok",
               "--max-inflight-requests", "3", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0
    requests = json.loads(out_json.read_text())["runs"][0]["requests"]
    rejected = [r for r in requests if r["error"] == "rejected"]
    ok = [r for r in requests if r["error"] is None]
    # a burst of 8 against a limit of 3: the first 3 get in, the rest cannot
    assert len(ok) >= 3 and rejected and len(ok) + len(rejected) == N
    assert f"Requests: {len(ok)}\nRejected: {len(rejected)}\n" in text
    assert f"Completion tokens (total): {len(ok) * 200}" in text
    assert re.search(r"^reject latency p50/p95/p99: [0-9.]+/[0-9.]+/[0-9.]+ ms$", text, flags=re.M)
    _check_requests(ok, 200)
    # pre-tokenized: the prompt was ready from the start, and its encode time is still reported
    assert all(r["tokenized"] is None and r["tokenize_s"] > 0 for r in ok)


def test_bad_flags_and_failed_requests(blog_flags: list[str], capsys) -> None:
    assert main(["bench", "streaming", *blog_flags, "--pretok", "--tokenize-workers", "2"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    # every request is refused (past the tiny model's 256-token context): reported, exit status 1
    assert main(["bench", "streaming", *blog_flags, "--max-new-tokens", "500"]) == 1
    assert f"Failed: {N} (first error: prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "streaming", "--prompt-repeats", "1,0"])
    with pytest.raises(SystemExit):
        main(["bench", "streaming", "--submit-schedule", "bursty"])


def _blog_command_line(tiny_model: str, *extra: str) -> list[str]:
    """The blog's streaming command line, scaled down to the tiny checkpoint on one CPU thread."""
    return ["--hf-model-id", tiny_model, "--device", "cpu", "--prompt", "Hello", "--pretok", "--tokenize-workers",
            "0", "--stream-interval", "8", "--num-requests", "4", "--warmup-runs", "1", "--repeat-runs", "1",
            "--submit-interval-ms", "20", "--submit-schedule", "absolute", "--max-batch-size", "4",
            "--prefill-max-batch-size", "4", "--max-new-tokens", "16", "--no-stop-on-eos", "--no-prefix-cache",
            *extra, "--num-threads", "1"]


@pytest.mark.parametrize("extra,golden", [
    ((), STREAMING),
    (("--unique-prompts", "--prompt-repeats", "8", "--max-inflight-requests", "2", "--paged-attn", "--cuda-graph",
      "--nvtx"), STREAMING_INFLIGHT),
], ids=["blog", "inflight"])
def test_python_dash_m_prints_the_blogs_lines(tiny_model_factory, extra: tuple[str, ...], golden: str) -> None:
    """`python -m roseinfer.benchmark_streaming` with the blog's command lines prints the blog's
    lines, character for character but the numbers."""
    proc = subprocess.run([sys.executable, "-m", "roseinfer.benchmark_streaming",
                           *_blog_command_line(str(tiny_model_factory("llama")), *extra)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert mask(proc.stdout) == mask(golden)
    # 4 requests of 16 tokens (the inflight limit may turn some away)
    requests = int(re.search(r"^Requests: (\d+)$", proc.stdout, flags=re.M).group(1))
    assert re.search(rf"^Completion tokens \(total\): {requests * 16}$", proc.stdout, flags=re.M)


def test_bench_help_lists_every_benchmark(capsys) -> None:
    """`roseinfer bench` lists every benchmark and `bench serve` is wired to the HTTP client."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("streaming", "offline", "throughput", "serve"))
    # nothing listens on the discard port: the client says so and exits 1
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-progress"]) == 1
    assert "is the server up?" in capsys.readouterr().err
