"""What refusing prefix caching costs a hybrid linear-attention model (Qwen3.5, Qwen3-Next,
Qwen3.5-MoE) on a shared-prefix workload: every request recomputes the shared prefix, where a cache
hit would leave only its own question. Measured on the model itself, the two sides alternating in one
run: the full prompts (prefix caching asked for, and refused) against what a cache would leave to
compute, the first request whole, then the others' questions alone (less the full-attention layers'
reads of the cached prefix: an underestimate of the hit's work, so the ratio is an upper bound on the
cost).

    python benchmarks/random_model.py qwen3.5-small /tmp/q35 --num-layers 8 --dtype float32
    python benchmarks/hybrid_prefix_cost.py /tmp/q35 --prefix-len 512 --question-len 32 --requests 8
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from roseinfer import LLM, SamplingParams


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model=args.model, enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    questions = [[rng.randrange(vocab) for _ in range(args.question_len)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    _timed(llm, questions[:1], params)  # warm-up
    full, hits = [], []
    for _ in range(args.rounds):
        full.append(_timed(llm, [prefix + q for q in questions], params))
        # the first request alone, then the rest: in one batch the linear layers' prefill would pad
        # every question to the first prompt's length
        hits.append(_timed(llm, [prefix + questions[0]], params) + _timed(llm, questions[1:], params))
    stats = llm.kv_cache_stats()
    full_s, hits_s = statistics.median(full), statistics.median(hits)
    print(f"model {args.model} ({llm.engine.model_config.model_type}); load average {os.getloadavg()[0]:.1f}; "
          f"prefix-cache hits {stats['prefix_cache_hits']}")
    print(f"{args.requests} requests of a shared {args.prefix_len}-token prefix + {args.question_len}-token question, "
          f"{args.max_tokens} new tokens each; median of {args.rounds}")
    print(f"full prompts (caching refused): {full_s:.3f} s   first whole, then questions (what hits compute): {hits_s:.3f} s   "
          f"cost of the refusal: {full_s / hits_s:.2f}x")


if __name__ == "__main__":
    main()
