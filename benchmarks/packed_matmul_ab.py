"""The packed-matmul kernel (and the one-call decode stack it enables) against oneDNN, in one process.

Two engines on the same model: one as the CPU backend builds it on this CPU, one with the kernel
turned off (every matmul to oneDNN, decode layer by layer). Rounds alternate between them, so drift
in the machine's load hits both; each prints its median per-token decode rate per batch size.

    python benchmarks/packed_matmul_ab.py [--model M] [--batch-sizes 1,16,64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics

from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import ops


def decode_rate(llm: LLM, prompt: list[int], batch: int, max_tokens: int) -> float:
    """Tokens per second of the batch's decode steps (the median request's, prefill left out)."""
    outs = llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    step = statistics.median((o.metrics["finished"] - o.metrics["first_token"]) / (len(o.token_ids) - 1) for o in outs)
    return batch / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    if not ops.packed_matmul_suits_cpu():
        raise SystemExit("the packed-matmul kernel does not run on this CPU: nothing to compare")
    kernel = LLM(args.model, enforce_eager=True)
    suits = ops.packed_matmul_suits_cpu
    ops.packed_matmul_suits_cpu = lambda: False  # read once, as the weights are packed at load
    try:
        onednn = LLM(args.model, enforce_eager=True)
    finally:
        ops.packed_matmul_suits_cpu = suits
    prompt = kernel.apply_chat_template([{"role": "user", "content": "Tell me a long story about the sea."}])
    print(f"kernel up to {ops.PACKED_MATMUL_MAX_ROWS} rows; decode tok/s per round, then the median")
    for batch in map(int, args.batch_sizes.split(",")):
        rates: dict[str, list[float]] = {"oneDNN": [], "kernel": []}
        for _ in range(args.rounds):
            for name, llm in (("oneDNN", onednn), ("kernel", kernel)):
                rates[name].append(decode_rate(llm, prompt, batch, args.max_tokens))
        a, b = (statistics.median(rates[name]) for name in ("oneDNN", "kernel"))
        rounds = {name: " ".join(f"{r:.1f}" for r in values) for name, values in rates.items()}
        print(f"batch {batch}: oneDNN {rounds['oneDNN']} (median {a:.1f}); kernel {rounds['kernel']} "
              f"(median {b:.1f}); kernel/oneDNN {b / a:.2f}")


if __name__ == "__main__":
    main()
