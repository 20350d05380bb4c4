"""roseinfer against llama.cpp on a real-shape quantized GGUF, with the memory-bandwidth floor.

Builds a random checkpoint of a real model's shape (random_model.py, the default model's tokenizer),
converts it with llama.cpp's own convert_hf_to_gguf.py to BF16 and quantizes that with llama-quantize
to each type asked for (Q4_K_M, Q8_0), once: the files stay in --work-dir (never in the repository).
Then, per file, in one run: roseinfer (`bench offline --model FILE --quantization gguf`, the blocks
kept) and llama-batched-bench on the same file, one batch of B sequences of --prompt-len prompt and
--max-new-tokens output tokens per batch size (output tok/s end to end), and prefill of
--prefill-batch prompts of --prefill-len tokens (prompt tok/s). The floor is a decode step's weight
bytes (every tensor but a looked-up embedding that is not also the LM head, and of a mixture of
experts only the routed experts' share) over the read bandwidth (a torch sum over a buffer larger than
the caches, --threads threads), read just before and just after the batch-1 runs, the larger of the
two; roseinfer's and llama.cpp's batch-1 decode steps are reported as fractions of it (floor time /
step time; 1.0 is at the floor). For a dense model, with batch sizes above 1, the exact path at
torch's fp32 GEMM rate too: that rate at a compute-bound shape (512 rows of x, a weight in cache) over
the multiply-adds of a token, decoding and end to end (prompt tokens cost the same multiply-adds but
the LM head's). It is a tuned GEMM's rate, not the FMA pipes' peak (on an AVX-512 Xeon a plain FMA
loop ran 1.2-1.4x it: docs/profiling.md section 19); at a decode batch's own few rows torch's rate is
lower, and roseinfer's tiles beat it there.

    python benchmarks/cpu_gguf_peers.py --llama-cpp LLAMA_CPP/build/bin [--shape smollm2-1.7b]
        [--types Q4_K_M,Q8_0] [--batch-sizes 1,16,64] [--threads 2] [--rounds 1] [--work-dir /tmp/gguf-peers]
        [--gguf FILE]
    python benchmarks/cpu_gguf_peers.py --llama-cpp LLAMA_CPP/build/bin --shape qwen3-30b-a3b --num-layers 8 \
        --types Q4_K_M --prefill-batch 4     (issue 39's mixture-of-experts table)
    python benchmarks/cpu_gguf_peers.py --llama-cpp LLAMA_CPP/build/bin --shape qwen3.5-small --types Q4_K_M \
        --prefill-batch 4     (issue 40's hybrid table: Gated DeltaNet beside gated full attention)

LLAMA_CPP is the llama.cpp checkout the binaries were built from (its convert_hf_to_gguf.py and gguf-py
are found two folders above build/bin; --llama-cpp-src overrides). The converter imports sentencepiece
(llama.cpp's requirements.txt): `pip install --target DIR sentencepiece` and put DIR on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
from cpu_peers import LlamaRow, llama_cpp_rows, roseinfer_summaries  # beside this script
from random_model import SHAPES, write_model

# the converter's Qwen3.5 expects a multi-token-prediction head, which transformers' random model lacks
CONVERTER_FLAGS = {"qwen3_5_text": ["--no-mtp"]}


def build_ggufs(shape: str, types: list[str], work_dir: pathlib.Path, bin_dir: pathlib.Path,
                src: pathlib.Path, num_layers: int | None = None) -> dict[str, pathlib.Path]:
    """The shape's quantized GGUFs, by type, built once into work_dir (num_layers: fewer layers than
    the shape's, named in the files); the checkpoint and the BF16 file only where a type is missing,
    so they can be deleted once the quantized files exist."""
    from roseinfer.loader.default_model import default_model_path

    name = shape if num_layers is None else f"{shape}-{num_layers}l"
    checkpoint, bf16 = work_dir / name, work_dir / f"{name}.BF16.gguf"
    files = {qtype: work_dir / f"{name}.{qtype}.gguf" for qtype in types}
    if all(f.exists() for f in files.values()):
        return files
    if not bf16.exists() and not (checkpoint / "config.json").exists():
        write_model(shape, checkpoint, torch.bfloat16, num_layers, tokenizer_from=pathlib.Path(default_model_path()))
    if not bf16.exists():
        # the converter imports sentencepiece even for a BPE tokenizer: it must be importable (PYTHONPATH)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "gguf-py"),
                                                                          os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(bf16), *CONVERTER_FLAGS.get(SHAPES[shape]["model_type"], [])], check=True, env=env, capture_output=True)
    for qtype in types:
        if not files[qtype].exists():
            subprocess.run([str(bin_dir / "llama-quantize"), str(bf16), str(files[qtype]), qtype], check=True,
                           capture_output=True)
    return files


def decode_weight_bytes(gguf: pathlib.Path, batch: int = 1) -> tuple[int, int, int]:
    """(bytes of weights one decode step of `batch` sequences reads, of which expert weights, and the
    expert weights in all): every tensor once, but an embedding table that is not also the LM head
    only for the rows it looks up (negligible, left out), and of a mixture of experts' stacked
    `ffn_*_exps` only the experts the step routes to: k of E at batch 1, E (1 - (1 - k/E)^B) expected
    for B sequences routed independently."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = str(reader.fields["general.architecture"].contents())
    counts = {key: reader.fields[f"{arch}.{key}"].contents() for key in ("expert_count", "expert_used_count")
              if f"{arch}.{key}" in reader.fields}
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in tensors
    dense = sum(n for name, n in tensors.items() if "_exps." not in name and (tied or name != "token_embd.weight"))
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    if not experts:
        return dense, 0, 0
    share = 1 - (1 - counts["expert_used_count"] / counts["expert_count"]) ** batch
    return dense + round(experts * share), round(experts * share), experts


def multiply_adds_per_token(gguf: pathlib.Path) -> tuple[int, int]:
    """Multiply-adds of one token's matmuls in a dense model, (below the LM head, the LM head): every
    2-D weight's elements, an embedding only where it is also the LM head (otherwise its rows are
    looked up)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_elements) for t in GGUFReader(str(gguf)).tensors if len(t.shape) == 2}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return sum(n for name, n in tensors.items() if name not in (head, "token_embd.weight")), tensors[head]


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block, then set back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def fp32_gemm_rate(threads: int, rows: int = 512, seconds: float = 1.0) -> float:
    """FLOP/s of torch's fp32 GEMM on `rows` rows of x against a 256 x 2048 weight (2 MB, in cache), with
    `threads` threads: what fp32 multiply-adds reach here when memory is not what binds them."""
    with torch_threads(threads):
        x, w = torch.randn(rows, 2048), torch.randn(256, 2048)
        for _ in range(50):
            torch.nn.functional.linear(x, w)
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(100):
                torch.nn.functional.linear(x, w)
            calls += 100
        return 2 * rows * 2048 * 256 * calls / (time.perf_counter() - start)


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s a sum over nbytes of fp32 reads with `threads` torch threads: the best of `repeats`."""
    with torch_threads(threads):
        buffer = torch.ones(nbytes // 4)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
    return nbytes / min(times)


def batch_runs(gguf: pathlib.Path, args: argparse.Namespace, sizes: list[int]) -> tuple[dict, dict, dict]:
    """roseinfer exact, roseinfer int8 ({} with --no-int8) and llama.cpp, one row per batch size."""
    shape = (args.prompt_len, args.max_new_tokens, args.threads)
    if not sizes:
        return {}, {}, {}
    ours = roseinfer_summaries(gguf, "gguf", sizes, *shape)
    ours_int8 = roseinfer_summaries(gguf, "gguf", sizes, *shape, cpu_activations="int8") if args.int8 else {}
    return ours, ours_int8, llama_cpp_rows(args.llama_cpp, gguf, sizes, *shape)


class Round(NamedTuple):
    """One round's measurements: per batch size roseinfer's summaries (exact, int8: {} with --no-int8)
    and llama.cpp's rows, the prefills, and the read bandwidth just before and after the batch-1 runs."""
    ours: dict[int, dict]
    ours_int8: dict[int, dict]
    peer: dict[int, LlamaRow]
    prefill: tuple[dict, dict | None, LlamaRow]
    bandwidths: list[float]


def run_round(gguf: pathlib.Path, args: argparse.Namespace, sizes: list[int]) -> Round:
    """Every column once: the batch sizes (roseinfer exact, int8, llama.cpp), then the prefills."""
    # batch 1 runs between two readings of the read bandwidth, which drifts by the minute on a shared host
    batch_one = [1] if 1 in sizes else []
    bandwidths = [read_bandwidth(args.threads) for _ in batch_one]
    ours, ours_int8, peer = batch_runs(gguf, args, batch_one)
    bandwidths += [read_bandwidth(args.threads) for _ in batch_one]
    for runs, more in zip((ours, ours_int8, peer), batch_runs(gguf, args, [b for b in sizes if b != 1])):
        runs.update(more)
    ours_prefill = roseinfer_summaries(gguf, "gguf", [args.prefill_batch], args.prefill_len, 1,
                                       args.threads)[args.prefill_batch]
    ours_int8_prefill = roseinfer_summaries(gguf, "gguf", [args.prefill_batch], args.prefill_len, 1, args.threads,
                                            "int8")[args.prefill_batch] if args.int8 else None
    peer_prefill = llama_cpp_rows(args.llama_cpp, gguf, [args.prefill_batch], args.prefill_len, 1,
                                  args.threads)[args.prefill_batch]
    return Round(ours, ours_int8, peer, (ours_prefill, ours_int8_prefill, peer_prefill), bandwidths)


def batch_cells(r: Round, batch: int) -> tuple[float, float | None, float]:
    """A round's output tok/s at one batch size: roseinfer exact, int8 (None without it), llama.cpp."""
    int8 = r.ours_int8[batch]["throughput_completion_total"] if r.ours_int8 else None
    return r.ours[batch]["throughput_completion_total"], int8, r.peer[batch].e2e


def prefill_cells(r: Round) -> tuple[float, float | None, float]:
    """A round's prefill tok/s: roseinfer exact, int8 (None without it), llama.cpp."""
    ours, int8, peer = r.prefill
    return ours["throughput_prefill"], int8["throughput_prefill"] if int8 else None, peer.prefill_rate


def medians(rounds_cells: list[tuple]) -> tuple:
    """Each cell's median over the rounds (None where the rounds have none)."""
    return tuple(None if cells[0] is None else statistics.median(cells) for cells in zip(*rounds_cells))


def compare(gguf: pathlib.Path, args: argparse.Namespace) -> None:
    """One file's table: roseinfer (exact, and with int8 activations), llama.cpp and the ratios per
    row, then the floor. With several rounds (each runs every column in turn) every cell is the
    median of its rounds and the ratios are the medians' ratios."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rounds = [run_round(gguf, args, sizes) for _ in range(args.rounds)]
    median = statistics.median
    rows = [(f"batch {b}, output tok/s", *medians([batch_cells(r, b) for r in rounds])) for b in sizes]
    rows.append((f"prefill, {args.prefill_batch} x {args.prefill_len} tokens, tok/s",
                 *medians([prefill_cells(r) for r in rounds])))
    print(f"\n{gguf.name}, {args.threads} threads, {args.prompt_len} prompt + {args.max_new_tokens} output tokens "
          f"a sequence, {'medians of ' + str(args.rounds) + ' rounds, ' if args.rounds > 1 else ''}"
          f"load average {os.getloadavg()[0]:.2f}")
    print("| | roseinfer | roseinfer int8 | llama.cpp | ratio | int8 ratio |\n|---|---:|---:|---:|---:|---:|")
    for label, exact, int8, theirs in rows:
        int8_cells = (f"{int8:.1f}", f"{int8 / theirs:.2f}") if int8 is not None else ("-", "-")
        print(f"| {label} | {exact:.1f} | {int8_cells[0]} | {theirs:.1f} | {exact / theirs:.2f} | {int8_cells[1]} |")
    if args.rounds > 1 and 1 in sizes:
        names = "roseinfer / int8 / llama.cpp" if args.int8 else "roseinfer / llama.cpp"
        print(f"batch 1 by round, output tok/s ({names}): " + "; ".join(
            " / ".join(f"{v:.1f}" for v in batch_cells(r, 1) if v is not None) for r in rounds))
    weights, read_experts, all_experts = decode_weight_bytes(gguf)
    if all_experts:
        print(f"expert weights: {all_experts / 1e9:.3f} GB in all; a batch-1 decode step reads "
              f"{read_experts / 1e9:.3f} GB of them ({read_experts / all_experts:.1%}); batch 16 "
              f"{decode_weight_bytes(gguf, 16)[1] / 1e9:.3f} GB, batch 64 {decode_weight_bytes(gguf, 64)[1] / 1e9:.3f} GB "
              f"(expected, routing independent)")
    bandwidths = [b for r in rounds for b in r.bandwidths]
    if bandwidths:
        # the largest reading: the smallest floor, so the strictest fraction
        bandwidth = max(bandwidths)
        floor = weights / bandwidth
        step = median(1 / r.ours[1]["throughput_decode_tokens"] for r in rounds)
        peer_step = median(1 / r.peer[1].decode_rate for r in rounds)
        int8 = ""
        if args.int8:
            int8_step = median(1 / r.ours_int8[1]["throughput_decode_tokens"] for r in rounds)
            int8 = f", int8 {int8_step * 1e3:.1f} ms ({floor / int8_step:.2f})"
        print(f"read bandwidth, {args.threads} threads, before and after the batch-1 runs: "
              + "; ".join(f"{r.bandwidths[0] / 1e9:.1f} and {r.bandwidths[1] / 1e9:.1f} GB/s" for r in rounds))
        print(f"batch-1 decode: floor {weights / 1e9:.3f} GB / {bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.1f} ms; "
              f"roseinfer step {step * 1e3:.1f} ms (floor/step {floor / step:.2f}){int8}, llama.cpp "
              f"{peer_step * 1e3:.1f} ms ({floor / peer_step:.2f})")
    if not all_experts and any(b > 1 for b in sizes):
        # the exact path multiplies fp32 activations by fp32 weights, at best as fast as a tuned fp32
        # GEMM (torch's runs below the FMA pipes' peak: docs/profiling.md section 19); end to end a
        # prompt token costs what an output token does (bar the LM head)
        layers, head = multiply_adds_per_token(gguf)
        rate, new = fp32_gemm_rate(args.threads), args.max_new_tokens
        per_sequence = (args.prompt_len + new - 1) * layers + new * head
        print(f"the exact path at torch's fp32 GEMM rate (512 rows in cache) {rate / 1e9:.1f} GFLOP/s / "
              f"{2 * (layers + head) / 1e9:.2f} GFLOP a token = {rate / (2 * (layers + head)):.1f} tok/s decoding, "
              f"{new * rate / (2 * per_sequence):.1f} output tok/s end to end at {args.prompt_len} prompt + "
              f"{new} output tokens a sequence (the rows above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=pathlib.Path, required=True,
                        help="folder with llama-batched-bench and llama-quantize")
    parser.add_argument("--llama-cpp-src", type=pathlib.Path, default=None,
                        help="llama.cpp's source folder (convert_hf_to_gguf.py; default: two above --llama-cpp)")
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--num-layers", type=int, default=None,
                        help="fewer layers than the shape's (qwen3-30b-a3b: what fits in memory)")
    parser.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize types, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=1, help="prompts prefilled together (issue 39's table: 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every column this many times in turn; the table shows each cell's median")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="the roseinfer int8-activations column too (--no-int8: the exact one only)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-peers"),
                        help="where the checkpoint and its GGUFs are built and kept")
    parser.add_argument("--gguf", type=pathlib.Path, action="append", default=None,
                        help="compare this existing file instead of building the shape's (repeatable)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    src = args.llama_cpp_src or args.llama_cpp.resolve().parents[1]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    files = ({f.name: f for f in args.gguf} if args.gguf
             else build_ggufs(args.shape, args.types.split(","), args.work_dir, args.llama_cpp, src,
                             args.num_layers))
    for gguf in files.values():
        compare(gguf, args)


if __name__ == "__main__":
    main()
