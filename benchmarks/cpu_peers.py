"""roseinfer against llama.cpp on the same GGUF, end to end, in one run on this machine.

Four columns, one after another in each round: `roseinfer bench offline` with the weights expanded
to fp32 (`--quantization none`), llama.cpp's `llama-batched-bench` on an F32 copy of the file (the
same values), roseinfer with the GGUF blocks kept (`--quantization gguf`), and llama.cpp on the file
itself. Each runs, per batch size B, one batch of B sequences of prompt-len prompt tokens and
max-new-tokens output tokens, all submitted at once; e2e is output tokens / total time for both
(llama.cpp: B x TG / T). With several rounds the table shows each column's median.

    python benchmarks/cpu_peers.py --llama-cpp BUILD/bin [--model GGUF] [--batch-sizes 1,16,64] [--threads 2]
                                   [--rounds 1]

BUILD/bin holds llama-batched-bench and llama-quantize (benchmarks/README.md, "llama.cpp on the same weights", says how
to build them from the llama-cpp-python sdist).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple

from roseinfer.config import EngineConfig

# llama-batched-bench's table: |PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|T s|S t/s|
LLAMA_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|" + r"\s*([0-9.]+)\s*\|" * 6)


class LlamaRow(NamedTuple):
    """One row of llama-batched-bench's table: B sequences of PP prompt and TG output tokens."""
    prompt_len: int
    new_tokens: int
    batch: int
    prefill_rate: float  # S_PP t/s
    decode_rate: float  # S_TG t/s
    total_s: float  # T s

    @property
    def e2e(self) -> float:
        return self.batch * self.new_tokens / self.total_s


def llama_cpp_rows(bin_dir: pathlib.Path, gguf: pathlib.Path, batch_sizes: list[int], prompt_len: int,
                   new_tokens: int, threads: int, cache_type: str = "f16") -> dict[int, LlamaRow]:
    """llama-batched-bench's rows per batch size. cache_type: its KV cache's; llama.cpp's default f16 ran
    batch 16 and 64 ~2x faster here than f32 (the engine's), so the peer runs at its best."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(max(batch_sizes) * (prompt_len + new_tokens)),
           "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-ctk", cache_type, "-ctv", cache_type]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        m = LLAMA_ROW.match(line)
        if m:
            rows[int(m.group(3))] = LlamaRow(int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(5)),
                                             float(m.group(7)), float(m.group(8)))
    missing = set(batch_sizes) - rows.keys()
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for batch sizes {sorted(missing)}:\n{out}")
    return rows


def llama_cpp_e2e(bin_dir: pathlib.Path, gguf: pathlib.Path, batch_sizes: list[int], prompt_len: int,
                  new_tokens: int, threads: int, cache_type: str = "f16") -> dict[int, float]:
    """Output tok/s end to end per batch size (B x TG / T)."""
    rows = llama_cpp_rows(bin_dir, gguf, batch_sizes, prompt_len, new_tokens, threads, cache_type)
    return {batch: row.e2e for batch, row in rows.items()}


def roseinfer_summaries(model: pathlib.Path, quantization: str, batch_sizes: list[int], prompt_len: int,
                        new_tokens: int, threads: int, cpu_activations: str = "auto") -> dict[int, dict[str, Any]]:
    """`roseinfer bench offline`'s JSON summary per batch size: one full batch of requests, all
    submitted at once, as llama-batched-bench runs them. The KV pool holds the whole batch, as
    llama-batched-bench's context (-c) does: a smaller pool would preempt and recompute."""
    summaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        for batch in batch_sizes:
            kv_blocks = batch * -(-(prompt_len + new_tokens) // EngineConfig.block_size)
            subprocess.run([sys.executable, "-m", "roseinfer.cli", "bench", "offline", "--model", str(model),
                            "--quantization", quantization, "--mode", "offline", "--batch-sizes", str(batch),
                            "--num-requests", str(batch), "--prompt-len", str(prompt_len),
                            "--max-new-tokens", str(new_tokens), "--no-stop-on-eos", "--num-threads", str(threads),
                            "--num-kv-blocks", str(kv_blocks), "--cpu-activations", cpu_activations,
                            "--json", str(report)], check=True, stdout=subprocess.DEVNULL)
            summaries[batch] = json.loads(report.read_text())["summary"][0]
            if summaries[batch]["num_preemptions"]:
                raise RuntimeError(f"batch {batch} was preempted {summaries[batch]['num_preemptions']} times "
                                   f"with {kv_blocks} KV blocks")
    return summaries


def roseinfer_e2e(model: pathlib.Path, quantization: str, batch_sizes: list[int], prompt_len: int, new_tokens: int,
                  threads: int) -> dict[int, float]:
    """Output tok/s end to end per batch size."""
    summaries = roseinfer_summaries(model, quantization, batch_sizes, prompt_len, new_tokens, threads)
    return {batch: summary["throughput_completion_total"] for batch, summary in summaries.items()}


def f32_copy(bin_dir: pathlib.Path, gguf: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The file's weights dequantized to F32 by llama.cpp itself: the values the fp32 engine holds."""
    target = folder / f"{gguf.stem}.F32.gguf"
    if not target.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(target), "F32"],
                       check=True, capture_output=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=pathlib.Path, required=True, help="folder with llama-batched-bench")
    parser.add_argument("--model", type=pathlib.Path, help="a quantized GGUF (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--llama-cache-type", default="f16", help="llama.cpp's KV cache type (its default: f16)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()),
                        help="where the F32 copy of the GGUF is kept between runs")
    args = parser.parse_args()
    if args.model is None:
        from roseinfer.loader.default_model import default_model_path

        args.model = pathlib.Path(default_model_path())
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    shape = (sizes, args.prompt_len, args.max_new_tokens, args.threads)
    peer = (*shape, args.llama_cache_type)
    f32 = f32_copy(args.llama_cpp, args.model, args.work_dir)
    runs: dict[str, list[dict[int, float]]] = {}
    for _ in range(args.rounds):
        for name, run in (("roseinfer fp32", lambda: roseinfer_e2e(args.model, "none", *shape)),
                          ("llama.cpp F32", lambda: llama_cpp_e2e(args.llama_cpp, f32, *peer)),
                          ("roseinfer gguf", lambda: roseinfer_e2e(args.model, "gguf", *shape)),
                          ("llama.cpp file", lambda: llama_cpp_e2e(args.llama_cpp, args.model, *peer))):
            runs.setdefault(name, []).append(run())
            print(f"{name}: " + ", ".join(f"batch {b} {v:.1f}" for b, v in runs[name][-1].items()), flush=True)
    columns = {name: {b: statistics.median(r[b] for r in rs) for b in sizes} for name, rs in runs.items()}
    print(f"{args.model.name}, {args.threads} threads, {args.prompt_len} prompt + {args.max_new_tokens} output "
          f"tokens a sequence, output tok/s end to end (medians of {args.rounds}); llama.cpp KV cache "
          f"{args.llama_cache_type}")
    print("| batch | " + " | ".join(columns) + " | fp32 ratio | quantized ratio |")
    print("|---:|" + "---:|" * (len(columns) + 2))
    for b in sizes:
        v = [columns[name][b] for name in columns]
        print(f"| {b} | " + " | ".join(f"{x:.1f}" for x in v) + f" | {v[0] / v[1]:.2f} | {v[2] / v[3]:.2f} |")


if __name__ == "__main__":
    main()
