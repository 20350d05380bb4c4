"""One decode step with the model split over N tensor-parallel ranks against the same step on one,
and what rank 0 spends communicating in it: sending the step to the workers, the all-reduces (two a
layer and the embedding's) and the logits' gather. A collective's time on rank 0 includes waiting
for the slowest rank to reach it, so it is communication plus the ranks' imbalance.

Usage: python benchmarks/tp_step.py [--model M] [--tensor-parallel-sizes 1,3] [--batch-size 1]
       [--steps 30] [--num-threads N]
--num-threads is the engine's (each of N ranks takes 1/N); default: torch's. The default model
(9 heads, 3 KV heads, MLP width 1536) splits over 1 or 3 ranks.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig


def timed(totals: dict[str, list[float]], name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals[name].append(time.perf_counter() - start)
    return wrapper


def measure(args: argparse.Namespace, size: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    blocks = args.batch_size * -(-(args.prompt_len + params.max_tokens) // EngineConfig.block_size)
    llm = LLM(model=args.model, tensor_parallel_size=size, num_threads=args.num_threads, num_kv_blocks=blocks)
    engine = llm.engine
    prompts = [[(i * 7 + j) % 1000 + 100 for j in range(args.prompt_len)] for i in range(args.batch_size)]
    llm.generate(prompts, params, use_tqdm=False)  # warm: kernels, oneDNN primitives, allocator sizes
    totals: dict[str, list[float]] = defaultdict(list)
    if size > 1:
        tp, ranks = engine.executor.ranks.tp, engine.executor.ranks
        tp.all_reduce = timed(totals, "all_reduce", tp.all_reduce)  # the layers call it through tp
        tp.gather_logits = timed(totals, "gather", tp.gather_logits)
        ranks.call = timed(totals, "send", ranks.call)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    totals.clear()
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    threads = torch.get_num_threads()
    llm.shutdown()
    result = {"size": size, "threads": threads, "step": statistics.median(steps) * 1e3}
    for name in ("send", "all_reduce", "gather"):
        result[name] = sum(totals[name]) / args.steps * 1e3
        result[name + "_calls"] = len(totals[name]) / args.steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tensor-parallel-sizes", default="1,3")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    print(f"batch {args.batch_size}, {args.steps} decode steps after a {args.prompt_len}-token prompt; "
          "times per step on rank 0 (median step; communication: mean)")
    print(f"{'ranks':>5s} {'threads/rank':>12s} {'step ms':>8s} {'send ms':>8s} {'all-reduce ms (calls)':>22s} "
          f"{'gather ms (calls)':>18s} {'rest ms':>8s}")
    for size in (int(s) for s in args.tensor_parallel_sizes.split(",")):
        r = measure(args, size)
        comm = r["send"] + r["all_reduce"] + r["gather"]
        print(f"{r['size']:5d} {r['threads']:12d} {r['step']:8.2f} {r['send']:8.3f} "
              f"{r['all_reduce']:12.2f} ({r['all_reduce_calls']:4.0f}) {r['gather']:10.3f} ({r['gather_calls']:3.0f}) "
              f"{r['step'] - comm:8.2f}", flush=True)


if __name__ == "__main__":
    main()
