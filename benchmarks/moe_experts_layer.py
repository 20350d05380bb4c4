"""One mixture-of-experts layer's routed experts on GGUF blocks, Qwen3-30B-A3B's shape (128 experts,
top-8, hidden 2048, width 768; gate/up Q4_K, down Q6_K as in a Q4_K_M file, random blocks): the
per-expert loop (backends/cpu/quantized_experts.py's QuantizedExperts: two block-kernel calls per
routed expert) against the one C call a layer (OneCallQuantizedExperts, csrc/moe_experts.c),
alternating in one process, ms a layer (median of --repeats) per token count and thread count.
With --int8: the one call with fp32 rows against the one call on the int8 path (--cpu-activations
int8: the experts repacked for csrc/q8_gemm.c, rows of x quantized to Q8_K) instead.

    python benchmarks/moe_experts_layer.py [--tokens 1,16,64,512] [--threads 1,2] [--repeats 5] [--int8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from roseinfer.backends.cpu import layers as cpu_layers
from roseinfer.backends.cpu import quantized_experts
from roseinfer.backends.cpu.quantized_experts import QuantizedExperts
from roseinfer.distributed.parallel import SINGLE
from roseinfer.models.moe import StackedExperts, select_experts

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
SCALE_BYTES = {QT.Q4_K: (0, 2), QT.Q6_K: (208,)}  # where each block's fp16 scales lie


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> torch.nn.Parameter:
    """[EXPERTS, rows, bytes] of random blocks whose fp16 scales are 2^-7 (timing does not read values)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(EXPERTS * rows * cols // block_weights, block_bytes), dtype=np.uint8)
    for offset in SCALE_BYTES[qtype]:
        raw[:, offset], raw[:, offset + 1] = 0x00, 0x20
    param = torch.nn.Parameter(torch.from_numpy(raw).view(EXPERTS, rows, -1), requires_grad=False)
    param.ggml_type = int(qtype)
    return param


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--int8", action="store_true", help="the one call against the one call on the int8 path")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    experts = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE)
    experts.gate_up_proj = random_blocks(QT.Q4_K, 2 * WIDTH, HIDDEN, rng)
    experts.down_proj = random_blocks(QT.Q6_K, HIDDEN, WIDTH, rng)
    cpu_layers.install(experts)
    int8_experts = None
    if args.int8:
        int8_experts = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE)
        int8_experts.gate_up_proj, int8_experts.down_proj = experts.gate_up_proj, experts.down_proj
        cpu_layers.install(int8_experts)
        quantized_experts.install(int8_experts, int8_activations=True)
    quantized_experts.install(experts)
    router = torch.randn(EXPERTS, HIDDEN)
    print(f"load average {os.getloadavg()[0]:.2f}")
    names = ("one call", "one call, int8") if args.int8 else ("per-expert loop", "one call")
    print(f"| tokens | threads | {names[0]}, ms | {names[1]}, ms | speed-up |\n|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, HIDDEN)
            weights, ids = select_experts(x @ router.T, TOP_K, renormalize=True)
            one_call = lambda: experts.forward(x, weights, ids)  # noqa: E731
            if int8_experts is None:
                first = lambda: QuantizedExperts.forward(experts, x, weights, ids)  # noqa: E731
                second = one_call
                assert torch.equal(first(), second())
            else:
                first, second = one_call, lambda: int8_experts.forward(x, weights, ids)  # noqa: E731
            first_ms, second_ms = [], []
            for _ in range(args.repeats):  # alternating, so both sides see the same load
                first_ms.append(median_ms(first, 1))
                second_ms.append(median_ms(second, 1))
            a, b = statistics.median(first_ms), statistics.median(second_ms)
            print(f"| {tokens} | {threads} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
