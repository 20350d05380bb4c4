"""``roseinfer bench offline --floor``: the matmul floor table beside the engine (and HF), its
samples and JSON, the prefill floor, peak RSS, and the floor functions themselves (bench/floor.py)
run on the models' own layers."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
import torch

from bench_helpers import ONE_THREAD, reported_values
from roseinfer.cli import main

pytestmark = pytest.mark.usefixtures("restore_torch_threads")


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


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
    assert reported_values(text, "Completion tokens") == [1 * 6] * 4 + [2 * 6] * 4
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
    from roseinfer.loader.model_loader import load_model_config
    from roseinfer.worker.worker import load_prepared_model

    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    backend = select_backend(backend_name, cpu, torch.float32, cfg)
    return load_prepared_model(folder, cfg, torch.float32, cpu, backend), backend, cfg


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
    expected = [(layer.native_weights, layer.native_type, layer.bias, layer.out_features, layer.in_features)
                for layer in layers]
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
