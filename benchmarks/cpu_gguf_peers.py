"""roseinfer against llama.cpp on a real-shape quantized GGUF, with the memory-bandwidth floor.

Builds a random checkpoint of a real model's shape (random_model.py, the default model's tokenizer),
converts it with llama.cpp's own convert_hf_to_gguf.py to BF16 and quantizes that with llama-quantize
to each type asked for (Q4_K_M, Q8_0), once: the files stay in --work-dir (never in the repository).
Then, per file, in one run: roseinfer (`bench offline --model FILE --quantization gguf`, the blocks
kept) and llama-batched-bench on the same file, one batch of B sequences of --prompt-len prompt and
--max-new-tokens output tokens per batch size (output tok/s end to end), and prefill of one
--prefill-len-token prompt (prompt tok/s). The floor is a decode step's weight bytes (every tensor
but a looked-up embedding that is not also the LM head) over the read bandwidth measured in the same
run (a torch sum over a buffer larger than the caches, --threads threads); roseinfer's batch-1 decode
step is reported as a fraction of it (floor time / step time; 1.0 is at the floor).

    python benchmarks/cpu_gguf_peers.py --llama-cpp LLAMA_CPP/build/bin [--shape smollm2-1.7b]
        [--types Q4_K_M,Q8_0] [--batch-sizes 1,16,64] [--threads 2] [--work-dir /tmp/gguf-peers] [--gguf FILE]

LLAMA_CPP is the llama.cpp checkout the binaries were built from (its convert_hf_to_gguf.py and gguf-py
are found two folders above build/bin; --llama-cpp-src overrides). The converter imports sentencepiece
(llama.cpp's requirements.txt): `pip install --target DIR sentencepiece` and put DIR on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
from cpu_peers import llama_cpp_rows, roseinfer_summaries  # beside this script
from random_model import SHAPES, write_model


def build_ggufs(shape: str, types: list[str], work_dir: pathlib.Path, bin_dir: pathlib.Path,
                src: pathlib.Path) -> dict[str, pathlib.Path]:
    """The shape's quantized GGUFs, by type, built once into work_dir."""
    from roseinfer.loader.default_model import default_model_path

    checkpoint, bf16 = work_dir / shape, work_dir / f"{shape}.BF16.gguf"
    if not (checkpoint / "config.json").exists():
        write_model(shape, checkpoint, torch.bfloat16, tokenizer_from=pathlib.Path(default_model_path()))
    if not bf16.exists():
        # the converter imports sentencepiece even for a BPE tokenizer: it must be importable (PYTHONPATH)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "gguf-py"),
                                                                          os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True, env=env, capture_output=True)
    files = {}
    for qtype in types:
        files[qtype] = work_dir / f"{shape}.{qtype}.gguf"
        if not files[qtype].exists():
            subprocess.run([str(bin_dir / "llama-quantize"), str(bf16), str(files[qtype]), qtype], check=True,
                           capture_output=True)
    return files


def weight_bytes_per_token(gguf: pathlib.Path) -> int:
    """Bytes of weights one decode step reads: every tensor once, but an embedding table that is not
    also the LM head only for the row it looks up (negligible, left out)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s a sum over nbytes of fp32 reads with `threads` torch threads: the best of `repeats`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(nbytes // 4)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return nbytes / min(times)


def compare(gguf: pathlib.Path, args: argparse.Namespace, bandwidth: float) -> None:
    """One file's table: roseinfer (exact, and with int8 activations), llama.cpp and the ratios per
    row, then the floor."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    shape = (args.prompt_len, args.max_new_tokens, args.threads)
    ours = roseinfer_summaries(gguf, "gguf", sizes, *shape)
    ours_int8 = roseinfer_summaries(gguf, "gguf", sizes, *shape, cpu_activations="int8")
    peer = llama_cpp_rows(args.llama_cpp, gguf, sizes, *shape)
    ours_prefill = roseinfer_summaries(gguf, "gguf", [1], args.prefill_len, 1, args.threads)[1]
    ours_int8_prefill = roseinfer_summaries(gguf, "gguf", [1], args.prefill_len, 1, args.threads, "int8")[1]
    peer_prefill = llama_cpp_rows(args.llama_cpp, gguf, [1], args.prefill_len, 1, args.threads)[1]
    rows = [(f"batch {b}, output tok/s", ours[b]["throughput_completion_total"],
             ours_int8[b]["throughput_completion_total"], peer[b].e2e) for b in sizes]
    rows.append((f"prefill, 1 x {args.prefill_len} tokens, tok/s", ours_prefill["throughput_prefill"],
                 ours_int8_prefill["throughput_prefill"], peer_prefill.prefill_rate))
    print(f"\n{gguf.name}, {args.threads} threads, {args.prompt_len} prompt + {args.max_new_tokens} output tokens "
          f"a sequence, load average {os.getloadavg()[0]:.2f}")
    print("| | roseinfer | roseinfer int8 | llama.cpp | ratio | int8 ratio |\n|---|---:|---:|---:|---:|---:|")
    for label, exact, int8, theirs in rows:
        print(f"| {label} | {exact:.1f} | {int8:.1f} | {theirs:.1f} | {exact / theirs:.2f} | {int8 / theirs:.2f} |")
    weights = weight_bytes_per_token(gguf)
    floor = weights / bandwidth
    if 1 in sizes:
        step, peer_step = 1 / ours[1]["throughput_decode_tokens"], 1 / peer[1].decode_rate
        int8_step = 1 / ours_int8[1]["throughput_decode_tokens"]
        print(f"batch-1 decode: floor {weights / 1e9:.3f} GB / {bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.1f} ms; "
              f"roseinfer step {step * 1e3:.1f} ms (floor/step {floor / step:.2f}), int8 {int8_step * 1e3:.1f} ms "
              f"({floor / int8_step:.2f}), llama.cpp {peer_step * 1e3:.1f} ms ({floor / peer_step:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=pathlib.Path, required=True,
                        help="folder with llama-batched-bench and llama-quantize")
    parser.add_argument("--llama-cpp-src", type=pathlib.Path, default=None,
                        help="llama.cpp's source folder (convert_hf_to_gguf.py; default: two above --llama-cpp)")
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize types, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-peers"),
                        help="where the checkpoint and its GGUFs are built and kept")
    parser.add_argument("--gguf", type=pathlib.Path, action="append", default=None,
                        help="compare this existing file instead of building the shape's (repeatable)")
    args = parser.parse_args()
    src = args.llama_cpp_src or args.llama_cpp.resolve().parents[1]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    files = ({f.name: f for f in args.gguf} if args.gguf
             else build_ggufs(args.shape, args.types.split(","), args.work_dir, args.llama_cpp, src))
    bandwidth = statistics.median(read_bandwidth(args.threads) for _ in range(3))
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s")
    for gguf in files.values():
        compare(gguf, args, bandwidth)


if __name__ == "__main__":
    main()
