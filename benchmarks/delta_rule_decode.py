"""The gated delta rule's decode step on CPU: the torch path (layers/attention.py
AttentionMetadata.delta_rule_decode: gather the states, recurrent_step, scatter them back) against
the CPU backend's C kernel (csrc/gated_delta_rule.c, in place on the pool), alternating, at Qwen3.5's
linear-layer shape (32 value heads of 128 x 128), for one layer at batch 1, 16 and 64.

    python benchmarks/delta_rule_decode.py [--threads N] [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from roseinfer.backends.cpu import ops
from roseinfer.layers.attention import AttentionMetadata

HEADS, DIM = 32, 128


def torch_path(*args: torch.Tensor) -> torch.Tensor:
    return AttentionMetadata.delta_rule_decode(None, *args)  # the base class's torch ops; it reads no state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; load average {os.getloadavg()[0]:.1f}")
    for batch in (1, 16, 64):
        q, k = (F.normalize(torch.randn(batch, HEADS, DIM), dim=-1) for _ in range(2))
        inputs = (q, k, torch.randn(batch, HEADS, DIM), -torch.rand(batch, HEADS), torch.rand(batch, HEADS),
                  torch.randn(batch + 1, HEADS, DIM, DIM) * 0.1, torch.arange(1, batch + 1), torch.ones(batch))
        times: dict[str, list[float]] = {"torch": [], "C": []}
        for _ in range(args.repeats):
            for name, step in (("torch", torch_path), ("C", ops.gated_delta_decode_)):
                start = time.perf_counter()
                step(*inputs)
                times[name].append(time.perf_counter() - start)
        torch_s, c_s = statistics.median(times["torch"]), statistics.median(times["C"])
        print(f"batch {batch:2d}: torch {torch_s * 1e3:8.2f} ms   C {c_s * 1e3:7.2f} ms   {torch_s / c_s:5.1f}x")


if __name__ == "__main__":
    main()
