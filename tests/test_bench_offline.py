"""``roseinfer bench offline`` (the blog's benchmark_scheduler) on the tiny llama checkpoint:
every mode on both backends, the blog's blocks (golden, numbers masked, through the stand-alone
``python -m roseinfer.benchmark_scheduler``), warmup exclusion, --batch-sizes, the blog's flags
(--prompts, --do-sample, --keep-prefix-cache-across-runs...) and --speculative-config. --floor is
test_bench_floor.py's."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
from blog_golden import SCHEDULER_NAIVE, SCHEDULER_ONLINE, SCHEDULER_PER_RUN, mask

from bench_helpers import ONE_THREAD, reported_values
from roseinfer.cli import main

N, PROMPT_LEN, NEW = 6, 12, 5


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def test_all_modes_both_backends(model: str, tmp_path, capsys) -> None:
    out_json = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "all", "--backend", "roseinfer,hf",
               "--num-requests", str(N), "--prompt-len", str(PROMPT_LEN), "--max-new-tokens", str(NEW),
               "--no-stop-on-eos", "--max-batch-size", "4", "--warmup-runs", "1", "--repeat-runs", "2",
               "--print-per-run", "--json", str(out_json), *ONE_THREAD])
    text = capsys.readouterr().out
    assert rc == 0
    # 3 modes x 2 backends x 2 measured runs, then a summary per batched mode and backend; the
    # warmup run is neither printed nor stored
    titles = re.findall(r"^=== (\w+)( summary)? \| backend=(\w+) \| batch_size=4 ===$", text, flags=re.M)
    expected = []
    for backend in ("roseinfer", "hf"):
        for mode in ("naive", "offline", "online"):
            expected += [(mode, "", backend)] * 2 + ([(mode, " summary", backend)] if mode != "naive" else [])
    assert titles == expected
    assert reported_values(text, "Completion tokens") == [N * NEW] * 12
    assert reported_values(text, "Prompt tokens") == [N * PROMPT_LEN] * 12
    assert reported_values(text, "Total tokens") == [N * (PROMPT_LEN + NEW)] * 12
    assert len(reported_values(text, "Elapsed")) == 4  # naive runs: no prefill/decode split
    for prefill, decode, total in zip(reported_values(text, "Elapsed (prefill/add)"), reported_values(text, "Elapsed (decode/run)"),
                                      reported_values(text, "Elapsed (total)")):
        assert 0 < prefill < total and decode == pytest.approx(total - prefill, abs=2e-6)
    assert len(reported_values(text, "Throughput (completion,total)")) == len(reported_values(text, "Throughput (total,total)")) == 12
    assert len(reported_values(text, "Throughput (completion,decode)")) == 8
    # each summary is the median and mean of its runs' blocks (two runs: both the mean)
    runs_total = reported_values(text, "Elapsed (total)")
    for i, summary in enumerate(re.findall(r"^Total time p50/mean: ([0-9.]+)/([0-9.]+) s$", text, flags=re.M)):
        assert [float(x) for x in summary] == pytest.approx([statistics.fmean(runs_total[2 * i:2 * i + 2])] * 2,
                                                            abs=2e-6)
    # latency lines in online summaries only: one per backend
    for label, unit in (("TTFT", "ms"), ("TPOT", "ms/token"), ("Latency", "ms")):
        assert len(re.findall(rf"^{label} p50/mean: [0-9.]+/[0-9.]+ {unit}$", text, flags=re.M)) == 2
    # --backend with hf: roseinfer's side-by-side table follows the blog's blocks
    assert text.index("=== summary (mean over repeat runs) ===") > text.rindex("=== online summary")

    report = json.loads(out_json.read_text())
    assert len(report["runs"]) == 12 and len(report["summary"]) == 6
    for row in report["summary"]:  # benchmarks/cpu_gguf_peers.py reads the decode and prefill rates from these
        runs = [r for r in report["runs"] if all(r[k] == row[k] for k in ("backend", "mode", "batch_size"))]
        for key in ("throughput_decode_tokens", "throughput_prefill"):
            assert row[key] == pytest.approx(statistics.fmean(r[key] for r in runs))
    for run in report["runs"]:
        assert run["num_requests"] == N and run["completion_tokens"] == N * NEW
        assert run["throughput_completion_total"] == pytest.approx(N * NEW / run["total_time_s"])
        assert all(ttft > 0 for ttft in run["ttft_s"])
        assert all(lat >= ttft for lat, ttft in zip(run["latency_s"], run["ttft_s"]))
    for run in report["runs"]:
        # batch size 4, 6 requests: the first 4 get their first token from one step, the
        # last 2 from a later one (roseinfer admits them as slots free, hf runs a second
        # batch); one at a time, every request has its own
        distinct = len(set(run["ttft_s"]))
        assert distinct == (N if run["mode"] == "naive" else 2), run["mode"]
    online = [run for run in report["runs"] if run["mode"] == "online"]
    ttft_p50s = [statistics.median(run["ttft_s"]) * 1000 for run in online]
    ttft = [float(x) for x in re.findall(r"^TTFT p50/mean: ([0-9.]+)/", text, flags=re.M)]
    assert ttft == pytest.approx([statistics.fmean(ttft_p50s[:2]), statistics.fmean(ttft_p50s[2:])], abs=0.006)

def test_batch_sizes_and_stop_on_eos(model: str, capsys) -> None:
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "online", "--batch-sizes", "1,3",
               "--num-requests", "3", "--prompt-len", "8", "--max-new-tokens", "4", "--warmup-runs", "0",
               "--print-per-run", *ONE_THREAD])
    text = capsys.readouterr().out
    assert rc == 0
    assert re.findall(r"^=== online summary \| backend=roseinfer \| batch_size=(\d) ===$", text, flags=re.M) == [
        "1", "3"]
    rows = re.findall(r"^roseinfer\s+online\s+(\d)\s+1\s", text, flags=re.M)
    assert rows == ["1", "3"]
    # stopping on EOS: never more than max_new_tokens per request
    assert all(0 < c <= 3 * 4 for c in reported_values(text, "Completion tokens"))


def test_bad_flags_are_one_line_errors(model: str, capsys) -> None:
    assert main(["bench", "offline", "--hf-model-id", model, "--repeat-runs", "0"]) == 2
    assert "error: --warmup-runs must be >= 0 and --repeat-runs >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--backend", "vllm"])


def _blog_command_line(tiny_model: str, *extra: str) -> list[str]:
    """The blog's scheduler command line, scaled down to the tiny checkpoint on one CPU thread."""
    return [sys.executable, "-m", "roseinfer.benchmark_scheduler", "--hf-model-id", tiny_model, "--device", "cpu",
            "--prompt", "Hello", "--num-requests", "4", "--max-new-tokens", "8", *extra, *ONE_THREAD]


@pytest.mark.parametrize("extra,golden", [
    (("--mode", "online", "--warmup-runs", "0", "--repeat-runs", "1"), SCHEDULER_ONLINE),
    (("--mode", "online", "--max-batch-size", "64", "--no-stop-on-eos", "--no-prefix-cache", "--pretok",
      "--warmup-runs", "1", "--repeat-runs", "3", "--paged-attn", "--cuda-graph", "--print-per-run"),
     SCHEDULER_PER_RUN),
    (("--mode", "naive", "--warmup-runs", "0", "--repeat-runs", "1", "--do-sample",
      "--keep-prefix-cache-across-runs"), SCHEDULER_NAIVE),
], ids=["online", "per-run", "naive"])
def test_python_dash_m_prints_the_blogs_lines(model: str, extra: tuple[str, ...], golden: str) -> None:
    """`python -m roseinfer.benchmark_scheduler` with the blog's command lines prints the blog's
    blocks, character for character but the numbers."""
    proc = subprocess.run(_blog_command_line(model, *extra), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert mask(proc.stdout) == mask(golden)
    if "--no-stop-on-eos" in extra:  # 4 requests of 8 tokens in each run's block
        assert reported_values(proc.stdout, "Completion tokens") == [32] * 3


def test_prompts_flag_and_hf_refuses_to_sample(model: str, tmp_path, capsys) -> None:
    """--prompts gives one request per text, cycled to --num-requests; HF's reference runs greedy
    only, so it refuses --do-sample rather than run greedy under a sampling flag."""
    from roseinfer.tokenizer import Tokenizer

    assert main(["bench", "offline", "--hf-model-id", model, "--backend", "hf", "--do-sample", *ONE_THREAD]) == 2
    assert "greedy only" in capsys.readouterr().err

    out_json = tmp_path / "prompts.json"
    texts = ["Hello", "Hello Hello Hello"]
    short, long = (len(Tokenizer(model).encode(t)) for t in texts)
    assert short < long
    for extra, lengths in (([], [short, long]), (["--num-requests", "3"], [short, long, short])):
        rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--prompt", "ignored",
                   "--prompts", *texts, *extra, "--max-new-tokens", "2", "--warmup-runs", "0",
                   "--json", str(out_json), *ONE_THREAD])
        assert rc == 0
        (run,) = json.loads(out_json.read_text())["runs"]
        assert run["num_requests"] == len(lengths) and run["prompt_tokens"] == sum(lengths)


@pytest.mark.parametrize("keep", [False, True])
def test_prefix_cache_is_emptied_between_runs_unless_kept(model: str, keep: bool, capsys) -> None:
    """As in the blog, each run starts from an empty prefix cache; with
    --keep-prefix-cache-across-runs the second run reuses the first one's blocks."""
    import argparse

    from roseinfer.bench.engine_flags import sampling_params_from_flags
    from roseinfer.bench.offline import RoseinferRunner, _run_modes
    from roseinfer.bench.offline_args import add_offline_args

    parser = argparse.ArgumentParser()
    add_offline_args(parser)
    # one request per run, its prompt two full KV blocks long: a hit can only come from the run before
    args = parser.parse_args(["--hf-model-id", model, "--prompt", " ".join(["Hello"] * 40), "--num-requests", "1",
                              "--max-new-tokens", "2", "--warmup-runs", "0", "--repeat-runs", "2", *ONE_THREAD,
                              *(["--keep-prefix-cache-across-runs"] if keep else [])])
    runner = RoseinferRunner(args, 1)
    _run_modes(args, runner, 1, ["offline"], runner.llm.tokenizer, sampling_params_from_flags(args), "")
    assert "=== offline summary ===" in capsys.readouterr().out
    hits = runner.engine.block_manager.stats.hits
    assert hits >= 32 if keep else hits == 0



@pytest.mark.parametrize("mode", ["offline", "online"])
@pytest.mark.parametrize("kv_blocks", [3, 64])
def test_preemptions_are_counted_and_named(model: str, mode: str, kv_blocks: int, tmp_path, capsys) -> None:
    """A KV pool too small for the batch preempts and recomputes: the run says so (a line and the
    JSON's count) rather than passing the recompute off as the engine's speed."""
    out_json = tmp_path / "offline.json"
    # 4 requests of 12 + 20 tokens need 2 blocks of 16 each: 3 blocks cannot hold even two of them
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", mode, "--num-requests", "4",
               "--prompt-len", "12", "--max-new-tokens", "20", "--no-stop-on-eos", "--warmup-runs", "0",
               "--num-kv-blocks", str(kv_blocks), "--json", str(out_json), *ONE_THREAD])
    text = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out_json.read_text())
    (run,), (row,) = report["runs"], report["summary"]
    assert run["completion_tokens"] == 4 * 20
    assert row["num_preemptions"] == run["num_preemptions"]
    if kv_blocks == 3:
        assert run["num_preemptions"] > 0
        assert f"Preemptions: {run['num_preemptions']} (the KV pool is smaller" in text
    else:
        assert run["num_preemptions"] == 0 and "Preemptions" not in text

# --------------------------------------------------------------------------- --floor

def test_do_sample_and_pack_flags() -> None:
    """Greedy stays the default; --do-sample samples at the blog's temperature 1.0 unless
    --temperature says otherwise; the blog's pack-policy flags reach the engine."""
    import argparse

    from roseinfer.bench.engine_flags import (add_engine_flags, add_sampling_flags, engine_config_from_flags,
                                              sampling_params_from_flags)

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    add_sampling_flags(parser)
    assert sampling_params_from_flags(parser.parse_args([])).greedy
    assert sampling_params_from_flags(parser.parse_args(["--do-sample"])).temperature == 1.0
    assert sampling_params_from_flags(parser.parse_args(["--do-sample", "--temperature", "0.5"])).temperature == 0.5
    assert sampling_params_from_flags(parser.parse_args(["--temperature", "0.7"])).temperature == 0.7
    with pytest.raises(ValueError, match="--do-sample"):
        sampling_params_from_flags(parser.parse_args(["--do-sample", "--temperature", "0"]))
    config = engine_config_from_flags(parser.parse_args(["--prefill-admission-lookahead", "5",
                                                         "--prefill-force-fifo-every", "3"]))
    assert (config.pack_lookahead, config.pack_fifo_every) == (5, 3)
    with pytest.raises(ValueError, match="pack_fifo_every"):
        engine_config_from_flags(parser.parse_args(["--prefill-force-fifo-every", "0"]))


def test_engine_flags_are_engine_configs_under_the_blogs_names_and_its_cuda_switches_are_real() -> None:
    """Every EngineConfig field but the seed (a sampling flag here) and enforce_eager (--cuda-graph) is
    a flag, at its own default; the blog's names reach the same fields."""
    import argparse
    from dataclasses import fields

    from roseinfer.bench.engine_flags import add_engine_flags, add_sampling_flags, engine_config_from_flags
    from roseinfer.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    add_sampling_flags(parser)
    defaults = engine_config_from_flags(parser.parse_args([]))
    for f in fields(EngineConfig):
        if f.name not in ("device", "enforce_eager"):  # device: auto resolved; enforce_eager: below
            assert getattr(defaults, f.name) == f.default, f.name
    assert defaults.device in ("cpu", "cuda") and defaults.enforce_eager  # the blog's runs were eager
    config = engine_config_from_flags(parser.parse_args(
        ["--hf-model-id", "m", "--max-batch-size", "7", "--no-prefix-cache", "--cuda-graph",
         "--attention-backend", "torch", "--device", "cpu"]))
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching) == ("m", 7, False)
    assert (config.enforce_eager, config.attention_backend) == (False, "torch")
    # --paged-attn picks the Triton backend on CUDA only: attention is always paged
    assert engine_config_from_flags(parser.parse_args(["--paged-attn", "--device", "cpu"])).attention_backend == "auto"
    assert engine_config_from_flags(parser.parse_args(["--paged-attn", "--device", "cuda"])).attention_backend == "triton"


def test_speculative_counters_are_printed_and_reported(model: str, tmp_path, capsys) -> None:
    """With --speculative-config the engine's counters follow its runs, in the text and the JSON;
    without it there is no such block."""
    out = tmp_path / "spec.json"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2})  # both requests
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--num-requests", "2",
               "--prompt", " ".join(["Hello world"] * 10), "--max-new-tokens", "8", "--warmup-runs", "0",
               "--speculative-config", spec, "--json", str(out), *ONE_THREAD])
    text = capsys.readouterr().out
    assert rc == 0
    assert "=== speculative decoding, all runs ===" in text
    (stats,) = json.loads(out.read_text())["speculative"].values()  # one batch size
    assert reported_values(text, "Drafts") == [stats["spec_num_drafts"]] and stats["spec_num_drafts"] > 0
    assert reported_values(text, "Accepted tokens") == [stats["spec_num_accepted_tokens"]]
    assert main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--num-requests", "1",
                 "--prompt-len", "8", "--max-new-tokens", "2", "--warmup-runs", "0", *ONE_THREAD]) == 0
    assert "speculative decoding" not in capsys.readouterr().out
