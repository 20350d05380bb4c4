"""Milliseconds per Sampler call on random logits: the working tree's sampler and, with --against,
the one at a git revision, called alternately in one process (the machines are noisy, see README).

Usage: python benchmarks/sampler_step.py [--against REV] [--batch-size 64] [--vocab 49152]
       [--prompt-len 32] [--output-len 64] [--logprobs N] [--seeded] [--greedy] [--no-penalties]
       [--top-p 0.9] [--top-k K] [--calls 30] [--num-threads N]
Each request has a prompt of --prompt-len and --output-len generated tokens; by default it samples
(temperature 0.8, top_p 0.9, no top_k) with repetition 1.1, frequency 0.5 and presence 0.3 penalties.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import statistics
import subprocess
import time
from types import ModuleType

import torch

from roseinfer.engine import sampler as current
from roseinfer.engine.request import Request
from roseinfer.sampling_params import SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[1]


def sampler_at(rev: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{rev}:roseinfer/engine/sampler.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"sampler_at_{rev}", loader=None))
    try:
        exec(compile(source, f"{rev}:roseinfer/engine/sampler.py", "exec"), module.__dict__)
    except ImportError as exc:  # it runs against today's package: older modules may be gone
        raise SystemExit(f"{rev}'s sampler imports what this tree no longer has ({exc}); run this script from "
                         f"a checkout of a revision closer to {rev}") from None
    return module


def requests(args: argparse.Namespace) -> list[Request]:
    """Fresh requests (seeded ones get fresh generators): each timed call starts from the same state."""
    rng = random.Random(0)
    penalties = {} if args.no_penalties else {"repetition_penalty": 1.1, "frequency_penalty": 0.5,
                                              "presence_penalty": 0.3}
    out = []
    for i in range(args.batch_size):
        params = SamplingParams(temperature=0.0 if args.greedy else 0.8, top_p=1.0 if args.greedy else args.top_p,
                                top_k=-1 if args.greedy else args.top_k,
                                seed=i if args.seeded else None, logprobs=args.logprobs,
                                max_tokens=args.output_len + 1, **penalties)
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        req = Request(f"r{i}", [rng.randrange(args.vocab) for _ in range(args.prompt_len)], params, generator=generator)
        req.token_ids.extend(rng.randrange(args.vocab) for _ in range(args.output_len))
        out.append(req)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default=None, help="also time the sampler at this git revision")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--seeded", action="store_true", help="every request carries its own seed")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--no-penalties", action="store_true")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    modules = {"working tree": current} | ({args.against: sampler_at(args.against)} if args.against else {})
    samplers = {name: m.Sampler({0}, torch.device("cpu"), 0) for name, m in modules.items()}
    logits = torch.randn(args.batch_size, args.vocab, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in samplers}
    with torch.inference_mode():
        for call in range(args.calls + 2):  # the first two warm up
            for name, sampler in samplers.items():
                batch = requests(args)
                start = time.perf_counter()
                sampler(logits, batch)
                if call >= 2:
                    times[name].append(time.perf_counter() - start)
    print(f"batch {args.batch_size}, vocab {args.vocab}, {args.prompt_len} + {args.output_len} tokens, "
          f"threads {torch.get_num_threads()}: median ms per call (min-max) over {args.calls} alternating calls")
    for name, samples in times.items():
        ms = [1e3 * t for t in samples]
        print(f"  {name:>14}: {statistics.median(ms):7.2f}  ({min(ms):.2f}-{max(ms):.2f})")


if __name__ == "__main__":
    main()
