"""`roseinfer bench throughput` (nano-vllm's workload, against HF's continuous batching), the
bandwidth floor's parts, and benchmarks/random_model.py (the GPU benchmarks' checkpoints)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_helpers import ONE_THREAD, benchmark_script, printed_bounds

from roseinfer.bench.floor import copy_bandwidth, decode_step_bytes
from roseinfer.bench.throughput import make_workload
from roseinfer.cli import main

pytestmark = pytest.mark.usefixtures("restore_torch_threads")
ROOT = Path(__file__).resolve().parents[1]


def test_workload_is_nano_vllms() -> None:
    w = make_workload(50, (3, 9), (2, 5), vocab_size=500, seed=1)
    assert len(w.prompts) == len(w.output_lens) == 50
    assert all(3 <= len(p) <= 9 and all(0 <= t < 500 for t in p) for p in w.prompts)
    assert all(2 <= n <= 5 for n in w.output_lens)
    assert {len(p) for p in w.prompts} == set(range(3, 10))  # uniform: every length turns up in 50 draws
    assert make_workload(50, (3, 9), (2, 5), 500, seed=1) == w
    assert all(t < 10_000 for p in make_workload(5, (50, 50), (1, 1), 150_000, 0).prompts for t in p)


def test_both_backends_make_every_token(tiny_model_factory, capsys, monkeypatch) -> None:
    # On CPU transformers sizes its continuous-batching cache from the machine's memory (90 % of it,
    # without psutil the NUMA node's) and fills it at start: 25 s here. 1 GiB holds this workload.
    from transformers.generation.continuous_batching import cache

    monkeypatch.setattr(cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 1 << 30, 0, 0))
    model = str(tiny_model_factory("qwen3"))
    rc = main(["bench", "throughput", "--model", model, "--num-prompts", "6", "--input-len", "5:20",
               "--output-len", "3:9", "--backend", "both", "--num-threads", "1"])
    text = capsys.readouterr().out
    assert rc == 0
    w = make_workload(6, (5, 20), (3, 9), vocab_size=384, seed=0)
    assert f"Requests: 6, input tokens {w.input_tokens} (5-20 each), output tokens {w.output_tokens} (3-9 each)" in text
    speeds = {}
    for backend in ("roseinfer", "hf"):
        match = re.search(rf"^{backend}: ([0-9.]+) s, output ([0-9.]+) tok/s, total ([0-9.]+) tok/s$", text, re.M)
        _, output, total = map(float, match.groups())
        # both rates are over one elapsed time, so they stand in the ratio of their token counts
        assert output / total == pytest.approx(w.output_tokens / (w.input_tokens + w.output_tokens), rel=1e-3)
        speeds[backend] = output
    ratio = float(re.search(r"^roseinfer / hf output throughput: ([0-9.]+)x$", text, re.M).group(1))
    assert ratio == pytest.approx(speeds["roseinfer"] / speeds["hf"], rel=0.02)


@pytest.mark.parametrize("flag", ["--input-len=0:5", "--output-len=9:3", "--input-len=a:b"])
def test_bad_length_ranges_are_refused(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", flag])
    assert exc.value.code == 2
    assert "MIN" in capsys.readouterr().err


def test_decode_step_bytes_counts_weights_once_and_every_context(tiny_model_factory) -> None:
    from roseinfer.backends import select_backend
    from roseinfer.loader.model_loader import load_model_config
    from roseinfer.worker.model_runner import ModelRunner
    from roseinfer.worker.worker import load_prepared_model

    folder = tiny_model_factory("llama")
    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    model = load_prepared_model(folder, cfg, torch.float32, cpu, select_backend("torch", cpu, torch.float32, cfg))
    h, ffn, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (cfg.num_heads * cfg.head_dim) * 2 + 2 * h * kv + 3 * h * ffn  # q, o; k, v; gate, up, down
    weights = 4 * (cfg.num_layers * per_layer + h * cfg.vocab_size)
    per_token = ModelRunner.kv_bytes_per_block(cfg, 1, torch.float32)
    assert per_token == 2 * cfg.num_layers * kv * 4
    assert decode_step_bytes(model, per_token, []) == weights
    assert decode_step_bytes(model, per_token, [10, 3]) == weights + 13 * per_token


def test_copy_bandwidth_is_a_rate() -> None:
    rate = copy_bandwidth(torch.device("cpu"), 8 << 20, repeats=3)
    assert 1e8 < rate < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
    with pytest.raises(ValueError):
        copy_bandwidth(torch.device("cpu"), 0)


def test_random_model_loads_and_its_tokenizer_round_trips(tmp_path) -> None:
    random_model = benchmark_script("random_model")
    random_model.write_model("qwen3-0.6b", tmp_path, torch.bfloat16, num_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["vocab_size"],
            config["head_dim"], config["num_key_value_heads"]) == ("qwen3", 1024, 1, 151936, 128, 8)
    from roseinfer import LLM, SamplingParams
    from roseinfer.tokenizer import Tokenizer

    tok = Tokenizer(tmp_path)
    ids = tok.encode("Hello, wörld")
    assert len(ids) == len("Hello, wörld".encode()) and tok.decode(ids) == "Hello, wörld"
    assert tok.eos_token_ids == {0}
    llm = LLM(str(tmp_path), num_threads=1, num_kv_blocks=8)
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and all(0 <= t < 151936 for t in out.token_ids)


def test_decode_bandwidth_script(tiny_model_factory) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_bandwidth.py"),
                           "--model", str(tiny_model_factory("llama")), "--batch-size", "3", "--prompt-len", "20",
                           "--steps", "3", "--copy-mib", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    step = re.search(r"batch 3, context 2\d-2\d tokens, median of 3 decode steps: ([0-9.]+) ms", proc.stdout)
    floor = re.search(r"floor ([0-9.e+-]+) ms -> floor/step ([0-9.]+)$", proc.stdout, re.M)
    assert step and floor
    # floor/step is of the unrounded figures: it lies within what their printed digits leave room for
    # (a step printed as 0.15 ms is anywhere in 0.145-0.155, 3 % either way)
    (step_lo, step_hi), (floor_lo, floor_hi) = printed_bounds(step.group(1)), printed_bounds(floor.group(1))
    ratio_lo, ratio_hi = printed_bounds(floor.group(2))
    assert floor_lo / step_hi <= ratio_hi and (step_lo <= 0 or ratio_lo <= floor_hi / step_lo), proc.stdout


def test_step_breakdown_script(tiny_model_factory) -> None:
    """benchmarks/step_breakdown.py drives the scheduler and runner by hand, so a change to their
    interfaces breaks it without breaking the engine: run it, and check its parts add up to its step."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"),
                           "--model", str(tiny_model_factory("llama")), "--batch-size", "2", "--prompt-len", "8",
                           "--steps", "3", *ONE_THREAD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    parts = dict(re.findall(r"^  (\S+)\s+([0-9.]+)  \(\s*[0-9.]+%\)$", proc.stdout, re.M))
    assert set(parts) == {"schedule", "prepare", "forward", "logits+sample", "update"}
    assert re.search(r"^  attention\s+-?[0-9.]+  \(layer-by-layer forward", proc.stdout, re.M)
    step = re.search(r"^  step\s+([0-9.]+)$", proc.stdout, re.M)
    assert step
    # the step is the sum of the unrounded parts: within what the six printed figures' rounding allows
    (step_lo, step_hi), bounds = printed_bounds(step.group(1)), [printed_bounds(ms) for ms in parts.values()]
    assert sum(lo for lo, _ in bounds) <= step_hi and step_lo <= sum(hi for _, hi in bounds), proc.stdout
    assert re.search(r"engine/floor [0-9.]+$", proc.stdout, re.M)
