"""Greedy against sampled decoding end to end in one engine, runs alternating (the machines are noisy,
see README): each run's output tok/s, the sampled / greedy ratio of each pair, and the median step
and sampler call of each kind, so the sampler's share of a step.

Usage: python benchmarks/sampled_decode.py [--model PATH] [--batch-size 64] [--prompt-len 32]
       [--output-len 48] [--rounds 3] [--temperature 0.8] [--top-p 0.95] [--top-k 50]
       [--repetition-penalty 1.1] [--num-threads N]
Without --model, the embedded default model. Prompts are random token ids; every request makes
exactly --output-len tokens (ignore_eos).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from roseinfer import LLM, SamplingParams


class Timed:
    """Wraps a callable, keeping each call's seconds."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.inner(*args)
        self.seconds.append(time.perf_counter() - start)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repetition-penalty", type=float, default=1.1)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    llm = LLM(model=args.model, max_num_seqs=args.batch_size, enable_prefix_caching=False)
    engine = llm.engine
    vocab = engine.runner.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch_size)]
    kinds = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
        "sampled": SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  repetition_penalty=args.repetition_penalty, max_tokens=args.output_len,
                                  ignore_eos=True),
    }
    step, sampler = Timed(engine.step), Timed(engine.runner.sampler)
    engine.step, engine.runner.sampler = step, sampler
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    steps: dict[str, list[float]] = {kind: [] for kind in kinds}
    calls: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds + 1):  # the first warms up
        for kind, params in kinds.items():
            step.seconds.clear()
            sampler.seconds.clear()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if round_ == 0:
                continue
            rates[kind].append(sum(len(o.token_ids) for o in outputs) / seconds)
            steps[kind] += step.seconds
            calls[kind] += sampler.seconds
    ratios = [s / g for s, g in zip(rates["sampled"], rates["greedy"])]
    print(f"vocab {vocab}, batch {args.batch_size}, {args.prompt_len} prompt / {args.output_len} output tokens, "
          f"threads {torch.get_num_threads()}, {args.rounds} rounds; sampled: {kinds['sampled']}")
    for kind in kinds:
        step_ms, call_ms = 1e3 * statistics.median(steps[kind]), 1e3 * statistics.median(calls[kind])
        print(f"  {kind:>8}: output tok/s {statistics.median(rates[kind]):8.1f} "
              f"({', '.join(f'{r:.1f}' for r in rates[kind])}); median step {step_ms:.1f} ms, "
              f"sampler {call_ms:.2f} ms ({100 * call_ms / step_ms:.1f} %)")
    print(f"  sampled / greedy: {statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
