"""benchmarks/cpu_peers.py reads llama-batched-bench's table (a stand-in executable prints one here) and sizes
roseinfer's KV pool for the batch."""
from __future__ import annotations

import pathlib
import stat

import pytest
from bench_helpers import benchmark_script

TABLE = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     64 |    1 |     96 |    0.082 |   390.15 |    1.600 |    40.00 |    2.000 |    48.00 |
|    32 |     64 |   16 |   1536 |    0.900 |   568.88 |    5.000 |   204.80 |    8.000 |   192.00 |
"""


def _fake_bench(tmp_path: pathlib.Path, table: str) -> pathlib.Path:
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat <<'END'\n{table}\nEND\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_llama_cpp_e2e_is_output_tokens_over_total_time(tmp_path) -> None:
    peers = benchmark_script("cpu_peers")
    got = peers.llama_cpp_e2e(_fake_bench(tmp_path, TABLE), tmp_path / "m.gguf", [1, 16], 32, 64, 2)
    assert got == pytest.approx({1: 64 / 2.0, 16: 16 * 64 / 8.0})
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-npl") + 1] == "1,16" and args[args.index("-ctk") + 1] == "f16"


def test_a_missing_batch_size_is_an_error(tmp_path) -> None:
    with pytest.raises(RuntimeError, match=r"no row for batch sizes \[64\]"):
        benchmark_script("cpu_peers").llama_cpp_e2e(_fake_bench(tmp_path, TABLE), tmp_path / "m.gguf", [1, 16, 64], 32, 64, 2)


def test_roseinfer_gets_a_kv_pool_that_holds_the_batch(tiny_model_factory) -> None:
    """As llama-batched-bench's context holds every sequence, so does the engine's pool, to the block:
    20 + 30 tokens take 4 blocks of 16 a sequence (3 would preempt, and the script would raise)."""
    summaries = benchmark_script("cpu_peers").roseinfer_summaries(tiny_model_factory("llama"), "none", [3], 20, 30, 1)
    assert summaries[3]["num_preemptions"] == 0 and summaries[3]["batch_size"] == 3
