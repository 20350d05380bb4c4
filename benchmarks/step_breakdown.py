"""Where one decode step's time goes: scheduling, batch building, forward, logits + sampling,
bookkeeping -- and attention (the layer-by-layer forward with and without it) -- beside the matmul
floor.

Usage: python benchmarks/step_breakdown.py [--model M] [--batch-size 64] [--steps 20] [--warm-steps 0]
       [--num-threads N]
--warm-steps decodes that many tokens first, so attention is measured at a longer context.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.bench.floor import matmul_floor
from roseinfer.layers import attention
from roseinfer.backends.cpu.llama import CPULlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-steps", type=int, default=0, help="decode steps before measuring (longer context)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto", help="auto (default), cpu, torch, triton")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.warm_steps + args.steps * 2 + 4, ignore_eos=True)
    # room for every sequence at full length: a preemption would distort the measured steps
    blocks_per_seq = -(-(args.prompt_len + params.max_tokens) // EngineConfig.block_size)
    llm = LLM(model=args.model, num_threads=args.num_threads, num_kv_blocks=args.batch_size * blocks_per_seq,
              attention_backend=args.attention_backend)
    engine, runner, scheduler = llm.engine, llm.engine.runner, llm.engine.scheduler
    prompts = [[(i * 7 + j) % 1000 + 100 for j in range(args.prompt_len)] for i in range(args.batch_size)]
    # One whole untimed round first, as `bench offline` warms up: kernels, oneDNN primitives and the
    # allocator reach the sizes the measured steps use.
    llm.generate(prompts, params)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.in_prefill for r in scheduler.running) or scheduler.waiting:
        engine.step()
    for _ in range(1 + args.warm_steps):
        engine.step()
    parts: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "forward", "logits+sample", "update")}
    stubbed: list[float] = []
    layer_by_layer: list[float] = []
    real_attention = attention.PagedAttention.__call__, attention.PagedAttention.forward_qkv
    real_stack = CPULlamaForCausalLM.decode_layers
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        with torch.inference_mode():
            layout, rows = runner._prepare(out.scheduled)
            ids, positions = runner.backend.tensor(layout.input_ids), runner.backend.tensor(layout.positions)
            meta = runner.backend.build_metadata(layout)
            t2 = time.perf_counter()
            hidden = runner.model(ids, positions, runner.kv_caches, meta)
            t3 = time.perf_counter()
            tokens, logprobs = runner.sampler(runner.model.compute_logits(hidden[rows]),
                                              [s.request for s in out.scheduled])
            t4 = time.perf_counter()
            # What attention costs (with the fused decode call, which also rotates q/k and writes the
            # cache): the layer-by-layer forward with and without attention replaced by the identity.
            # The one-call C decode stack (csrc/decode_layers.c) cannot leave it out, so it is off here.
            CPULlamaForCausalLM.decode_layers = lambda self, kv_caches: None
            t5 = time.perf_counter()
            runner.model(ids, positions, runner.kv_caches, meta)
            layer_by_layer.append(time.perf_counter() - t5)
            attention.PagedAttention.__call__ = lambda self, q, k, v, cache, m: q
            attention.PagedAttention.forward_qkv = lambda self, qkv, rope, cache, m: qkv[
                :, :self.num_heads * self.head_dim]
            t5 = time.perf_counter()
            runner.model(ids, positions, runner.kv_caches, meta)
            stubbed.append(time.perf_counter() - t5)
            attention.PagedAttention.__call__, attention.PagedAttention.forward_qkv = real_attention
            CPULlamaForCausalLM.decode_layers = real_stack
        t6 = time.perf_counter()
        scheduler.update(out, [[token] for token in tokens], logprobs)  # one token per decode row
        t7 = time.perf_counter()
        for key, a, b in (("schedule", t0, t1), ("prepare", t1, t2), ("forward", t2, t3),
                          ("logits+sample", t3, t4), ("update", t6, t7)):
            parts[key].append(b - a)
    floor = statistics.median(matmul_floor(runner.model, runner.backend, args.batch_size) for _ in range(3))
    med = {k: statistics.median(v) * 1000 for k, v in parts.items()}
    step = sum(med.values())
    context = args.prompt_len + 1 + args.warm_steps
    print(f"batch {args.batch_size}, {torch.get_num_threads()} threads, context ~{context} tokens, "
          f"median over {args.steps} decode steps (ms):")
    for key, value in med.items():
        print(f"  {key:<14} {value:8.2f}  ({value / step:6.1%})")
    print(f"  {'step':<14} {step:8.2f}")
    attention_ms = (statistics.median(layer_by_layer) - statistics.median(stubbed)) * 1000
    print(f"  attention      {attention_ms:8.2f}  (layer-by-layer forward {statistics.median(layer_by_layer) * 1000:.2f} "
          f"minus the same without attention)")
    overhead = med["schedule"] + med["prepare"] + med["update"]
    print(f"  engine overhead (schedule + prepare + update) {overhead:.2f} ms = {overhead / step:.1%} of the step")
    print(f"matmul floor step {args.batch_size / floor * 1000:.2f} ms -> engine/floor {args.batch_size / floor * 1000 / step:.2f}")
    engine.pop_finished_ids()


if __name__ == "__main__":
    main()
