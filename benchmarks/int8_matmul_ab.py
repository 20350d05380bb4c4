"""One GGUF-block matmul with fp32 rows (the exact path) against int8 rows (--cpu-activations int8).

A weight of --rows x --cols (default 8192 x 2048: SmolLM2-1.7B's gate/up shape) in random blocks of
each type, times 1 to 512 rows of x, the kernels alternating in every round; prints the best wall
time and the process CPU time per call of each (CPU time, both threads' together, is what to read on a
busy machine), their ratio, and the int8 kernel's weight bytes per wall second. Q4_K, Q6_K, Q8_0, Q5_0 and
Q5_1 also run the repacked int8 GEMM (csrc/q8_gemm.c, what the engine runs for them), against the unpacked
int8 kernel on the same blocks. With --gguf FILE, a decode step's matmuls on that file instead: every quantized 2-D
weight once (a tied embedding as the LM head), times each row count, the CPU time of the whole step,
exact, int8 on the blocks and int8 as the engine runs it (the GEMM where it repacks).

    python benchmarks/int8_matmul_ab.py [--types Q4_K,Q6_K,Q8_0] [--rows-of-x 1,16,64,512] [--threads 2]
        [--gguf FILE]
"""
from __future__ import annotations

import argparse
import os
import resource
import time
import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.quantized import INT8_ACTIVATIONS, INT8_REPACKED, REPACKED_TYPES

# where each type keeps its fp16 scales: set to 2^-7 so the random blocks hold finite, moderate values
SCALE_BYTES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}


def random_blocks(qtype: str, rows: int, cols: int) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_BYTES[qtype]:
        data[:, :, offset], data[:, :, offset + 1] = 0x00, 0x20
    return torch.from_numpy(data.reshape(rows, -1))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def step_weights(path: str) -> list[tuple[torch.Tensor, int, int]]:
    """(blocks [n, bytes a row], GGML type, k) of every quantized 2-D tensor of a GGUF file."""
    from gguf import GGUFReader

    weights = []
    # the tensors are read-only maps of the file, which torch warns about; the kernels only read them
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) == 2 and tensor.tensor_type.name in SCALE_BYTES:
            blocks = torch.from_numpy(np.ascontiguousarray(tensor.data)).view(torch.uint8)
            weights.append((blocks.reshape(int(tensor.shape[1]), -1), int(tensor.tensor_type), int(tensor.shape[0])))
    return weights


def gguf_steps(path: str, rows_of_x: list[int], rounds: int) -> None:
    """The step's matmuls three ways: fp32 rows, int8 rows on the blocks, and int8 rows as the engine runs
    them (the repacked types' GEMM, a tied LM head's copy included)."""
    weights = step_weights(path)
    total = sum(blocks.numel() for blocks, _, _ in weights)
    kinds: dict[str, list[tuple[torch.Tensor, int, int, int]]] = {"exact": [], "int8": [], "int8 GEMM": []}
    for blocks, code, k in weights:
        n = blocks.shape[0]
        kinds["exact"].append((blocks, code, n, k))
        kinds["int8"].append((blocks, code | INT8_ACTIVATIONS, n, k))
        if GGMLQuantizationType(code) in REPACKED_TYPES:
            kinds["int8 GEMM"].append((ops.repack_for_int8_gemm(blocks, code, k),
                                       code | INT8_ACTIVATIONS | INT8_REPACKED, n, k))
        else:
            kinds["int8 GEMM"].append((blocks, code | INT8_ACTIVATIONS, n, k))
    print(f"{path}: {len(weights)} weights, {total / 1e9:.3f} GB; CPU ms of one step's matmuls")
    print("| rows of x | exact | int8 | int8 GEMM | int8 / GEMM |\n|---|---:|---:|---:|---:|")
    for m in rows_of_x:
        x = torch.randn(m, max(k for _, _, k in weights))
        best = {name: float("inf") for name in kinds}
        for _ in range(rounds):
            for name, calls in kinds.items():
                start = cpu_seconds()
                for blocks, kind, n, k in calls:
                    ops.weight_matmul(x[:, :k], blocks.data_ptr(), kind, n, None)
                best[name] = min(best[name], cpu_seconds() - start)
        print(f"| {m} | {best['exact'] * 1e3:.0f} | {best['int8'] * 1e3:.0f} | {best['int8 GEMM'] * 1e3:.0f} | "
              f"{best['int8'] / best['int8 GEMM']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--rows-of-x", default="1,16,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", default=None, help="a decode step's matmuls on this file instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.gguf:
        print(f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}")
        gguf_steps(args.gguf, [int(v) for v in args.rows_of_x.split(",")], args.rounds)
        return
    print(f"{args.rows} x {args.cols}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print("| type | rows of x | fp32 ms (CPU ms) | int8 ms (CPU ms) | CPU ratio | int8 weight GB/s "
          "| int8 GEMM ms (CPU ms) | GEMM / int8 CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for qtype in args.types.split(","):
        weight = random_blocks(qtype, args.rows, args.cols)
        code = int(GGMLQuantizationType[qtype])
        kernels = {"fp32": (weight, code), "int8": (weight, code | INT8_ACTIVATIONS)}
        if GGMLQuantizationType[qtype] in REPACKED_TYPES:
            kernels["gemm"] = (ops.repack_for_int8_gemm(weight, code, args.cols), code | INT8_ACTIVATIONS | INT8_REPACKED)
        for m in (int(v) for v in args.rows_of_x.split(",")):
            x = torch.randn(m, args.cols)
            calls = max(2, 256 // m)
            best = {name: (float("inf"), float("inf")) for name in kernels}
            for _ in range(args.rounds):
                for name, (blocks, kind) in kernels.items():
                    ops.weight_matmul(x, blocks.data_ptr(), kind, args.rows, None)
                    wall, cpu = time.perf_counter(), cpu_seconds()
                    for _ in range(calls):
                        ops.weight_matmul(x, blocks.data_ptr(), kind, args.rows, None)
                    wall, cpu = (time.perf_counter() - wall) / calls, (cpu_seconds() - cpu) / calls
                    best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
            (fw, fc), (iw, ic) = best["fp32"], best["int8"]
            gw, gc = best.get("gemm", (float("nan"), float("nan")))
            print(f"| {qtype} | {m} | {fw * 1e3:.2f} ({fc * 1e3:.2f}) | {iw * 1e3:.2f} ({ic * 1e3:.2f}) | "
                  f"{fc / ic:.2f} | {weight.numel() / iw / 1e9:.1f} | {gw * 1e3:.2f} ({gc * 1e3:.2f}) | {ic / gc:.2f} |")

if __name__ == "__main__":
    main()
