"""``roseinfer bench offline`` (the blog's benchmark_scheduler) on the tiny llama checkpoint:
every mode on both backends, the blog's blocks (golden, numbers masked, through the stand-alone
``python -m roseinfer.benchmark_scheduler``), warmup exclusion, --batch-sizes, the blog's flags
(--prompts, --do-sample, --keep-prefix-cache-across-runs...), and --floor (the matmul floor
table) with its helpers."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys

import pytest
import torch
from blog_golden import SCHEDULER_NAIVE, SCHEDULER_ONLINE, SCHEDULER_PER_RUN, mask

from roseinfer.cli import main

N, PROMPT_LEN, NEW = 6, 12, 5
# One torch thread: on a small shared CPU, tiny matmuls spread over two threads spend
# most of their time waking the second one (20x slower here).
ONE_THREAD = ["--num-threads", "1"]


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _value(text: str, label: str) -> list[float]:
    return [float(x) for x in re.findall(rf"^{re.escape(label)}: ([0-9.]+)", text, flags=re.M)]


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
    assert _value(text, "Completion tokens") == [N * NEW] * 12
    assert _value(text, "Prompt tokens") == [N * PROMPT_LEN] * 12
    assert _value(text, "Total tokens") == [N * (PROMPT_LEN + NEW)] * 12
    assert len(_value(text, "Elapsed")) == 4  # naive runs: no prefill/decode split
    for prefill, decode, total in zip(_value(text, "Elapsed (prefill/add)"), _value(text, "Elapsed (decode/run)"),
                                      _value(text, "Elapsed (total)")):
        assert 0 < prefill < total and decode == pytest.approx(total - prefill, abs=2e-6)
    assert len(_value(text, "Throughput (completion,total)")) == len(_value(text, "Throughput (total,total)")) == 12
    assert len(_value(text, "Throughput (completion,decode)")) == 8
    # each summary is the median and mean of its runs' blocks (two runs: both the mean)
    runs_total = _value(text, "Elapsed (total)")
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
    assert all(0 < c <= 3 * 4 for c in _value(text, "Completion tokens"))


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
        assert _value(proc.stdout, "Completion tokens") == [32] * 3


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
    from roseinfer.bench.offline import RoseinferRunner, _run_modes, add_offline_args

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


# --------------------------------------------------------------------------- --floor

FLOOR_COLUMNS = ["batch", "engine decode tok/s", "floor tok/s", "decode/floor", "e2e tok/s", "e2e/floor",
                 "run floor tok/s", "e2e/run floor", "hf tok/s"]


def _markdown_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the Markdown table printed after the floor heading."""
    lines = [ln for ln in text[text.index("=== matmul floor"):].splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert set("".join(cells[1])) <= set("-:"), "second line is the Markdown alignment row"
    return cells[0], cells[2:]


def test_floor_table(model: str, tmp_path, capsys) -> None:
    out_json = tmp_path / "floor.json"
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--floor", "--batch-sizes", "1,2",
               "--backend", "both", "--prompt-len", "8", "--max-new-tokens", "6", "--no-stop-on-eos",
               "--warmup-runs", "1", "--repeat-runs", "2", "--floor-steps", "4", "--print-per-run",
               "--json", str(out_json), *ONE_THREAD])
    text = capsys.readouterr().out
    assert rc == 0
    # one batch of B requests per batch size; a floor sample before and after each measured run
    assert _value(text, "Completion tokens") == [1 * 6] * 4 + [2 * 6] * 4
    samples = re.findall(r"^Matmul floor \(batch_size=(\d), sample (\d)\): ([0-9.]+) tokens/s$", text, flags=re.M)
    assert [(b, s) for b, s, _ in samples] == [("1", "1"), ("1", "2"), ("1", "3"), ("2", "1"), ("2", "2"), ("2", "3")]
    assert all(float(v) > 0 for *_, v in samples)
    prefill_samples = re.findall(r"^Prefill matmul floor \(batch_size=(\d), sample (\d)\): ([0-9.]+) prompt tokens/s$",
                                 text, flags=re.M)
    assert [(b, s) for b, s, _ in prefill_samples] == [(b, s) for b, s, _ in samples]
    assert all(float(v) > 0 for *_, v in prefill_samples)
    # the table comes after the usual summary, in Markdown
    assert text.index("=== summary (mean over repeat runs) ===") < text.index("=== matmul floor (mode=offline, threads=1")
    header, rows = _markdown_rows(text)
    # prompts of 8 tokens: B=1,2 prefill in one step, so the prefill column is there too
    assert header == FLOOR_COLUMNS + ["prefill tok/s", "prefill floor tok/s", "prefill/floor"]
    assert [r[0] for r in rows] == ["1", "2"]
    for row in rows:
        values = [float(c) for c in row[1:]]
        assert all(v > 0 and math.isfinite(v) for v in values), row
        decode, floor, decode_ratio, e2e, e2e_ratio, run_floor, e2e_run_ratio = values[:7]
        assert decode_ratio == pytest.approx(decode / floor, rel=0.02, abs=0.01)
        assert e2e_ratio == pytest.approx(e2e / floor, rel=0.02, abs=0.01)
        assert e2e_run_ratio == pytest.approx(e2e / run_floor, rel=0.02, abs=0.01)
        prefill, prefill_floor, prefill_ratio = values[-3:]
        assert prefill_ratio == pytest.approx(prefill / prefill_floor, rel=0.02, abs=0.01)

    report = json.loads(out_json.read_text())
    assert report["floor"]["mode"] == "offline" and report["floor"]["threads"] == 1
    table = report["floor"]["rows"]
    assert [r["batch_size"] for r in table] == [1, 2] and all(r["num_requests"] == r["batch_size"] for r in table)
    for r in table:
        assert len(r["floor_samples_tok_s"]) == 3 and r["floor_tok_s"] == statistics.median(r["floor_samples_tok_s"])
        assert r["decode_over_floor"] == pytest.approx(r["engine_decode_tok_s"] / r["floor_tok_s"])
        assert r["e2e_over_floor"] == pytest.approx(r["e2e_tok_s"] / r["floor_tok_s"])
        assert len(r["prefill_floor_samples_tok_s"]) == 3
        assert r["prefill_floor_tok_s"] == statistics.median(r["prefill_floor_samples_tok_s"])
        assert r["prefill_over_floor"] == pytest.approx(r["prefill_tok_s"] / r["prefill_floor_tok_s"])
        assert r["hf_tok_s"] > 0 and r["prefill_tok_s"] > 0
        # the run at both floors: 8 prompt tokens per request at the prefill floor, then 5 more
        # tokens per request at the decode floor
        n = r["batch_size"]
        seconds = 8 * n / r["prefill_floor_tok_s"] + 5 * n / r["floor_tok_s"]
        assert r["run_floor_tok_s"] == pytest.approx(6 * n / seconds)
        assert r["e2e_over_run_floor"] == pytest.approx(r["e2e_tok_s"] / r["run_floor_tok_s"])
    for run in report["runs"]:
        # decode tokens: everything after each request's first token
        assert run["decode_tokens"] == run["completion_tokens"] - run["num_requests"]


def test_floor_table_reports_peak_rss_without_hf(model: str, tmp_path, capsys) -> None:
    """Without HF's model in the process, each row carries the engine's peak RSS and its budget."""
    out_json = tmp_path / "floor.json"
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--floor", "--batch-sizes", "2",
               "--prompt-len", "8", "--max-new-tokens", "4", "--no-stop-on-eos", "--warmup-runs", "0",
               "--repeat-runs", "1", "--floor-steps", "2", "--json", str(out_json), *ONE_THREAD])
    assert rc == 0
    header, rows = _markdown_rows(capsys.readouterr().out)
    assert header[-2:] == ["peak RSS MB", "RSS budget MB"]
    (row,) = json.loads(out_json.read_text())["floor"]["rows"]
    assert row["rss_budget_mb"] == pytest.approx(row["weights_mb"] + row["kv_pool_mb"] + 300)
    # the weights are resident (the KV pool only where touched, and this test process holds
    # transformers and more, so no upper bound is asserted here)
    assert row["peak_rss_mb"] > row["weights_mb"]
    assert [float(c) for c in rows[0][-2:]] == pytest.approx([row["peak_rss_mb"], row["rss_budget_mb"]], abs=0.5)


def test_engine_peak_rss_leaves_out_what_it_is_told_to() -> None:
    """The floor samples run in the engine's process; their memory must not count as the engine's."""
    from roseinfer.bench.memory import EnginePeakRss, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("this kernel cannot restart the resident high-water mark (/proc/self/clear_refs)")
    size = 256 * 2**20
    peak = EnginePeakRss()
    start = peak.bytes()

    def floor_sample(mode: str) -> None:
        assert mode == "offline"
        torch.ones(size // 4)  # touched, then freed

    peak.excluding(floor_sample)("offline")
    assert peak.bytes() < start + size // 4
    kept = torch.ones(size // 4)
    assert peak.bytes() > start + size * 3 // 4
    del kept


@pytest.mark.parametrize("new_tokens,shown", [(1, True), (3, False)])
def test_prefill_over_several_steps_is_reported_only_without_decode_work(model: str, capsys, new_tokens: int,
                                                                          shown: bool) -> None:
    """Two 8-token prompts under an 8-token step budget take two prefill steps: their time to
    the last first token is prefill only when no request decodes (one token each)."""
    rc = main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--floor", "--batch-sizes", "2",
               "--backend", "roseinfer", "--prompt-len", "8", "--max-num-batched-tokens", "8",
               "--max-new-tokens", str(new_tokens), "--no-stop-on-eos", "--warmup-runs", "0", "--repeat-runs", "1",
               "--floor-steps", "2", *ONE_THREAD])
    header, rows = _markdown_rows(capsys.readouterr().out)
    assert rc == 0 and ("prefill/floor" in header) == shown
    if shown:  # one token each: a prefill figure and no decode figure (not "0.0")
        assert float(rows[0][header.index("prefill tok/s")]) > 0
        assert rows[0][header.index("engine decode tok/s")] == rows[0][header.index("decode/floor")] == "–"
        assert rows[0][header.index("e2e/floor")] == "–" and float(rows[0][header.index("e2e tok/s")]) > 0
        # without later tokens the run floor is the prefill floor, in completion tokens (one per prompt)
        assert float(rows[0][header.index("run floor tok/s")]) == pytest.approx(
            float(rows[0][header.index("prefill floor tok/s")]) / 8, rel=0.02, abs=0.1)
    else:
        assert float(rows[0][header.index("engine decode tok/s")]) > 0


def test_floor_flag_errors(model: str, capsys) -> None:
    assert main(["bench", "offline", "--hf-model-id", model, "--floor", "--mode", "naive", *ONE_THREAD]) == 2
    assert "--floor compares batched runs" in capsys.readouterr().err
    assert main(["bench", "offline", "--hf-model-id", model, "--floor", "--backend", "hf", *ONE_THREAD]) == 2
    assert "include the roseinfer backend" in capsys.readouterr().err


def _loaded(folder, backend_name: str):
    from roseinfer.backends import select_backend
    from roseinfer.loader.model_loader import load_model, load_model_config

    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    backend = select_backend(backend_name, cpu, torch.float32, cfg)
    return load_model(folder, cfg, torch.float32, cpu, backend), backend, cfg


@pytest.mark.parametrize("arch,backend_name", [("llama", "auto"), ("gpt2", "auto"), ("llama3_rope_untied", "torch")])
def test_matmul_floor_runs_the_models_own_linear_layers(tiny_model_factory, arch: str, backend_name: str,
                                                         monkeypatch) -> None:
    from roseinfer.backends.cpu import ops
    from roseinfer.bench.floor import matmul_floor
    from roseinfer.layers.linear import Linear, linear_layers

    m, backend, cfg = _loaded(tiny_model_factory(arch), backend_name)
    layers = linear_layers(m)
    # every matmul once, the LM head last, packed exactly when the engine packs
    assert layers[-1] is m.lm_head and (m.lm_head.in_features, m.lm_head.out_features) == (cfg.hidden_size,
                                                                                           cfg.vocab_size)
    assert all((layer.weight is None) == (backend.name == "cpu") for layer in layers)
    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 0)  # every layer from Python, also on AVX-512
    calls: list[Linear] = []
    for cls in {type(layer) for layer in layers}:
        real_forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, x, _real=real_forward: calls.append(self) or _real(self, x))
    matmul_floor(m, backend, 2, steps=1, warmup=0)
    assert calls == layers
    monkeypatch.undo()
    torch.set_num_threads(1)
    for bs in (1, 3):
        tok_s = matmul_floor(m, backend, bs, steps=3, warmup=1)
        assert tok_s > 0 and math.isfinite(tok_s)
    with pytest.raises(ValueError):
        matmul_floor(m, backend, 0)


def test_matmul_floor_runs_from_c_where_the_engines_decode_layers_do(tiny_model_factory, monkeypatch,
                                                                     packed_matmul_on_any_cpu) -> None:
    """Where every matmul of a decode step runs in csrc/packed_matmul.c (so the engine runs its layers
    in one C call), the floor runs every layer's packed weight, in order, from one C loop per sample:
    Python between the matmuls would slow the floor and not the engine. Above the C kernel's row
    limit it calls the layers from Python."""
    from roseinfer.backends.cpu import CPUBackend, ops
    from roseinfer.backends.cpu.layers import PackedLinear
    from roseinfer.bench.floor import matmul_floor
    from roseinfer.layers.linear import linear_layers

    if not CPUBackend.supports(torch.device("cpu"), torch.float32):
        pytest.skip("needs the C kernels")
    m, backend, _ = _loaded(tiny_model_factory("llama"), "cpu")
    layers = linear_layers(m)
    if any(layer.native_weights is None for layer in layers):
        pytest.skip("the packed matmul kernel does not run here (oneDNN does not pack 64-row blocks here)")
    c_steps: list[tuple[list, int, int]] = []
    real_steps = ops.packed_matmul_steps
    monkeypatch.setattr(ops, "packed_matmul_steps",
                        lambda weights, x, steps: c_steps.append((weights, x.shape[0], steps)) or
                        real_steps(weights, x, steps))
    python_calls: list[int] = []
    real_forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward",
                        lambda self, x: python_calls.append(x.shape[0]) or real_forward(self, x))
    assert matmul_floor(m, backend, 3, steps=4, warmup=1) > 0
    expected = [(layer.native_weights, layer.bias, layer.out_features, layer.in_features) for layer in layers]
    assert [(w, rows, steps) for w, rows, steps in c_steps] == [(expected, 3, 1), (expected, 3, 4)]
    assert python_calls == []
    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 2)
    matmul_floor(m, backend, 3, steps=1, warmup=0)
    assert len(c_steps) == 2 and python_calls == [3] * len(layers)


def test_prefill_floor_runs_every_layer_on_each_steps_rows_and_the_head_once_per_prompt(tiny_model_factory,
                                                                                        monkeypatch) -> None:
    from roseinfer.bench.floor import prefill_matmul_floor
    from roseinfer.layers.linear import Linear, linear_layers

    m, _, _ = _loaded(tiny_model_factory("llama"), "auto")
    layers = linear_layers(m)
    calls: list[tuple[Linear, int]] = []
    real_forward = type(layers[0]).forward
    monkeypatch.setattr(type(layers[0]), "forward",
                        lambda self, x: calls.append((self, x.shape[0])) or real_forward(self, x))
    # 3 prompts x 5 tokens in steps of 6 rows: an untimed 6-row step, then 6 + 6 + 3 rows, then the head on 3
    tok_s = prefill_matmul_floor(m, num_prompts=3, prompt_len=5, step_tokens=6)
    assert tok_s > 0 and math.isfinite(tok_s)
    body = layers[:-1]
    assert calls == [(layer, rows) for rows in (6, 6, 6, 3) for layer in body] + [(m.lm_head, 3)]
    with pytest.raises(ValueError):
        prefill_matmul_floor(m, 0, 5, 6)


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
    assert _value(text, "Drafts") == [stats["spec_num_drafts"]] and stats["spec_num_drafts"] > 0
    assert _value(text, "Accepted tokens") == [stats["spec_num_accepted_tokens"]]
    assert main(["bench", "offline", "--hf-model-id", model, "--mode", "offline", "--num-requests", "1",
                 "--prompt-len", "8", "--max-new-tokens", "2", "--warmup-runs", "0", *ONE_THREAD]) == 0
    assert "speculative decoding" not in capsys.readouterr().out
