"""Where a GPU decode step's time goes: the step as it runs, then each phase timed with the device
synchronized around it (schedule, batch building, forward, LM head, sampler, update), then the
top CUDA kernels of a few steps (torch.profiler). The host/device split that says whether a step
is bound by Python or by kernels.

Usage: python benchmarks/gpu_step_profile.py --model M [--batch-size 256] [--prompt-len 512]
       [--steps 10] [--enforce-eager]
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig


def timed_steps(step: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synced(obj: Any, name: str, phases: dict[str, list[float]]) -> None:
    """Replace obj.name with a copy that waits for the device before and after itself."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        torch.cuda.synchronize()
        phases[name].append(time.perf_counter() - start)
        return result

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=3 * args.steps + 10, ignore_eos=True)
    max_len = args.prompt_len + params.max_tokens
    llm = LLM(model=args.model, device="cuda", max_num_seqs=args.batch_size, enable_prefix_caching=False,
              num_kv_blocks=args.batch_size * -(-max_len // EngineConfig.block_size), max_model_len=max_len,
              max_num_batched_tokens=max(2048, args.prompt_len), enforce_eager=args.enforce_eager)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    for _ in range(args.batch_size):
        engine.add_request([rng.randrange(1000) for _ in range(args.prompt_len)], params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    timed_steps(engine.step, 3)
    print(f"{runner.backend.name}, {engine.dtype}, batch {args.batch_size}, context ~{args.prompt_len}: "
          f"step {timed_steps(engine.step, args.steps) * 1e3:.2f} ms")
    phases: dict[str, list[float]] = collections.defaultdict(list)
    for obj, name in ((engine.scheduler, "schedule"), (runner, "_prepare"), (runner.backend, "forward"),
                      (runner.model, "compute_logits"), (runner, "sampler"), (engine.scheduler, "update")):
        synced(obj, name, phases)
    print(f"with the device synchronized around each phase: step {timed_steps(engine.step, args.steps) * 1e3:.2f} ms")
    for name, times in phases.items():
        print(f"  {name:15s} {statistics.median(times) * 1e3:7.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
