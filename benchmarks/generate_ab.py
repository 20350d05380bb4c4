"""CPU per output token and tok/s of `LLM.generate`, two sides alternating in one run, each run in a
fresh process: this tree against another checkout (--against DIR, e.g. a `git worktree` of another
revision), or engine options against each other (--options '{"async_scheduling": "off"}' '{...}').

Usage: python benchmarks/generate_ab.py --model M [--against DIR] [--options JSON ...] [--rounds 3]
       [--num-prompts 128] [--prompt-len 32] [--max-tokens 64] [--num-threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import hashlib, json, sys, time
from roseinfer import LLM, SamplingParams
model, options, n, prompt_len, max_tokens, threads = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
llm = LLM(model=model, num_threads=threads, **options)
prompts = [[(i * 7 + j) % 300 + 50 for j in range(prompt_len)] for i in range(n)]
llm.generate(prompts[:16], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
llm.reset_prefix_cache()
start, cpu = time.perf_counter(), time.process_time()
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
tokens = sum(len(o.token_ids) for o in outs)
print(json.dumps({"tok_s": tokens / wall, "cpu_us": 1e6 * cpu / tokens, "outputs": hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--against", default=None, help="another checkout's root: its roseinfer is side B")
    parser.add_argument("--options", nargs="*", default=["{}"], help="engine options as JSON, one side each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    sides = [(here, o) for o in args.options] + ([(args.against, args.options[0])] if args.against else [])
    results: dict[int, list[dict]] = {i: [] for i in range(len(sides))}
    for r in range(args.rounds):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            tree, options = sides[i]
            done = subprocess.run([sys.executable, "-c", CHILD, args.model, options, str(args.num_prompts),
                                   str(args.prompt_len), str(args.max_tokens), str(args.num_threads)],
                                  env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, cwd="/")
            if done.returncode != 0:
                raise SystemExit(done.stderr[-3000:])
            results[i].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{tree} {options}: {results[i][-1]}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for i, (tree, options) in enumerate(sides):
        runs = results[i]
        print(f"{tree} {options}: CPU us/token {[round(x['cpu_us'], 1) for x in runs]} "
              f"(median {statistics.median(x['cpu_us'] for x in runs):.1f}), "
              f"tok/s median {statistics.median(x['tok_s'] for x in runs):.0f}, "
              f"same outputs in every run: {len({x['outputs'] for x in runs}) == 1}")


if __name__ == "__main__":
    main()
