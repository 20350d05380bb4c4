"""The gated delta rule on CPU, one layer at Qwen3.5's linear-layer shape (32 value heads of 128 x 128):
the torch paths (layers/attention.py AttentionMetadata: gather the states, recurrent_step or
chunked_prefill, scatter them back) against the CPU backend's C kernels (csrc/gated_delta_rule.c, in
place on the pool), alternating: the decode step at batch 1, 16 and 64, and the prefill of
--prefill-batch sequences of --prefill-len tokens.

    python benchmarks/delta_rule_kernels.py [--threads N] [--repeats 7] [--prefill-batch 4] [--prefill-len 512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from roseinfer.backends.cpu import delta_rule_ops
from roseinfer.layers.attention import AttentionMetadata

HEADS, DIM = 32, 128


def torch_decode(*args: torch.Tensor) -> torch.Tensor:
    return AttentionMetadata.delta_rule_decode(None, *args)  # the base class's torch ops; it reads no state


def torch_prefill(*args: torch.Tensor) -> torch.Tensor:
    return AttentionMetadata.delta_rule_prefill(None, *args)


def alternate(paths: dict[str, Callable[..., torch.Tensor]], inputs: tuple[torch.Tensor, ...],
              repeats: int) -> dict[str, float]:
    """Each path's median time over `repeats` rounds, the paths alternating within a round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, step in paths.items():
            start = time.perf_counter()
            step(*inputs)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; load average {os.getloadavg()[0]:.1f}")
    for batch in (1, 16, 64):
        q, k = (F.normalize(torch.randn(batch, HEADS, DIM), dim=-1) for _ in range(2))
        inputs = (q, k, torch.randn(batch, HEADS, DIM), -torch.rand(batch, HEADS), torch.rand(batch, HEADS),
                  torch.randn(batch + 1, HEADS, DIM, DIM) * 0.1, torch.arange(1, batch + 1), torch.ones(batch))
        med = alternate({"torch": torch_decode, "C": delta_rule_ops.gated_delta_decode_}, inputs, args.repeats)
        print(f"decode, batch {batch:2d}: torch {med['torch'] * 1e3:8.2f} ms   C {med['C'] * 1e3:7.2f} ms   "
              f"{med['torch'] / med['C']:5.1f}x")
    batch, length = args.prefill_batch, args.prefill_len
    q, k = (F.normalize(torch.randn(batch, length, HEADS, DIM), dim=-1) for _ in range(2))
    inputs = (q, k, torch.randn(batch, length, HEADS, DIM), -torch.rand(batch, length, HEADS),
              torch.rand(batch, length, HEADS), torch.randn(batch + 1, HEADS, DIM, DIM) * 0.1,
              torch.arange(1, batch + 1), torch.ones(batch), torch.full((batch,), length))
    med = alternate({"torch": torch_prefill, "C": delta_rule_ops.gated_delta_prefill_}, inputs, args.repeats)
    print(f"prefill, {batch} x {length}: torch {med['torch'] * 1e3:8.2f} ms   C {med['C'] * 1e3:7.2f} ms   "
          f"{med['torch'] / med['C']:5.1f}x")

if __name__ == "__main__":
    main()
