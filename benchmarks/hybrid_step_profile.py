"""Where a hybrid model's step goes (Qwen3.5 / Qwen3-Next: Gated DeltaNet beside gated full attention):
a decode step at each batch size and one prefill step of --prefill-batch prompts, split into the
linear layers' projections, causal conv, delta-rule recurrence and the rest of their code; the full
attention layers; the MLPs; the LM head with sampling; and what is left (norms, residuals, the
engine's own Python). Each part is timed by wrapping its function, so the figures include the
wrappers' cost (a few microseconds a call).

    python benchmarks/hybrid_step_profile.py --model FILE.gguf [--quantization gguf] [--batch-sizes 1,16]
        [--prefill-batch 4] [--prefill-len 512] [--steps 10] [--num-threads 2]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

from roseinfer import LLM, SamplingParams
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.models import qwen3_5

Totals = collections.defaultdict[str, float]


@contextlib.contextmanager
def timed(targets: list[tuple[Any, str, str]], totals: Totals) -> Iterator[None]:
    """Wrap each (owner, attribute) so its calls add their wall time to totals[label]."""
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]

    def wrap(fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
        return inner

    for (owner, attr, label), (_, _, fn) in zip(targets, originals):
        setattr(owner, attr, wrap(fn, label))
    try:
        yield
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def all_subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *all_subclasses(direct))]


def targets(llm: LLM) -> list[tuple[Any, str, str]]:
    """What to time: the linear layers' parts by name inside their module, the other blocks whole."""
    model = llm.engine.runner.model
    parts: list[tuple[Any, str, str]] = []
    for layer in model.model.layers:
        if layer.is_linear:
            mixer = layer.linear_attn
            parts += [(mixer, "forward", "linear layer (all)"), (mixer.in_proj, "forward", "linear: in_proj"),
                      (mixer.out_proj, "forward", "linear: out_proj")]
        else:
            parts.append((layer.self_attn, "forward", "full attention layer"))
        parts.append((layer.mlp, "forward", "MLP"))
    # the base class's torch recurrence and every backend's own
    for step in ("delta_rule_decode", "delta_rule_prefill"):
        parts += [(c, step, "linear: delta rule") for c in [AttentionMetadata, *all_subclasses(AttentionMetadata)]
                  if step in vars(c)]
    parts += [(qwen3_5, "conv_decode", "linear: conv"), (qwen3_5, "conv_prefill", "linear: conv"),
              (model, "compute_logits", "LM head"), (llm.engine.runner.sampler, "launch", "sampler"),
              (llm.engine.runner.sampler, "read", "sampler")]
    return parts


def profile_steps(llm: LLM, prompts: list[list[int]], new_tokens: int, steps: int, prefill: bool) -> tuple[Totals, float, int]:
    """(part totals, step time, steps measured) over `steps` decode steps, or over the prompts' prefill."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    if not prefill:
        while any(r.in_prefill for r in scheduler.running) or scheduler.waiting:
            engine.step()
        engine.step()
    totals: Totals = collections.defaultdict(float)
    measured, start = 0, time.perf_counter()
    with timed(targets(llm), totals):
        while measured < steps and (scheduler.running or scheduler.waiting):
            engine.step()
            measured += 1
            if prefill and not any(r.in_prefill for r in scheduler.running) and not scheduler.waiting:
                break
    elapsed = time.perf_counter() - start
    while scheduler.running or scheduler.waiting:
        engine.step()
    engine.pop_finished_ids()
    return totals, elapsed, measured


def report(title: str, totals: Totals, elapsed: float, steps: int) -> None:
    linear_parts = sum(v for k, v in totals.items() if k.startswith("linear:"))
    rows = dict(totals)
    rows["linear: the rest (gates, norm, q/k/v heads, Python)"] = totals["linear layer (all)"] - linear_parts
    rows["the rest (embedding, norms, residuals, engine)"] = elapsed - sum(
        v for k, v in totals.items() if not k.startswith("linear:"))
    print(f"\n{title}: {elapsed / steps * 1e3:.1f} ms a step over {steps} steps")
    for label, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<52} {seconds / steps * 1e3:9.2f} ms  {seconds / elapsed:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model, quantization=args.quantization, num_threads=args.num_threads)
    vocab = llm.engine.runner.model.cfg.vocab_size

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[(i * 7919 + j * 104729) % vocab for j in range(length)] for i in range(count)]

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    profile_steps(llm, prompts(max(sizes), args.prompt_len), 4, 2, prefill=False)  # warm-up
    for batch in sizes:
        totals, elapsed, steps = profile_steps(llm, prompts(batch, args.prompt_len), args.steps + 4, args.steps,
                                               prefill=False)
        report(f"decode, batch {batch}", totals, elapsed, steps)
    totals, elapsed, steps = profile_steps(llm, prompts(args.prefill_batch, args.prefill_len), 1, 100, prefill=True)
    report(f"prefill, {args.prefill_batch} x {args.prefill_len} tokens", totals, elapsed, steps)


if __name__ == "__main__":
    main()
