"""One decode step against the bandwidth floor: the bytes a step must read (every weight once, every
sequence's KV context) over the device-to-device copy bandwidth measured in the same run. The
figure that says how close a memory-bound GPU decode step gets to its hardware.

Usage: python benchmarks/decode_bandwidth.py [--model M] [--batch-size 256] [--prompt-len 512]
       [--steps 20] [--device auto] [--dtype auto] [--attention-backend auto] [--enforce-eager]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


from roseinfer import LLM, SamplingParams
from roseinfer.bench.floor import copy_bandwidth, decode_step_bytes
from roseinfer.config import BACKEND_NAMES, EngineConfig
from roseinfer.worker.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed (default: %(default)s)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--copy-mib", type=int, default=1024, help="buffer copied to measure bandwidth")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    # room for every sequence at full length: a preemption would distort the measured steps
    blocks_per_seq = -(-(args.prompt_len + params.max_tokens) // EngineConfig.block_size)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_num_seqs=args.batch_size, enable_prefix_caching=False,
              num_kv_blocks=args.batch_size * blocks_per_seq,
              max_num_batched_tokens=max(2048, args.prompt_len), max_model_len=args.prompt_len + params.max_tokens)
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab, 10_000)) for _ in range(args.prompt_len)] for _ in range(args.batch_size)]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first all-decode step, untimed
    times, contexts = [], []
    for _ in range(args.steps):
        contexts.append([r.num_tokens for r in engine.scheduler.running])
        start = time.perf_counter()
        engine.step()  # returns after the step's tokens are copied to the host
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    per_token = ModelRunner.kv_bytes_per_block(engine.model_config, 1, engine.dtype)
    needed = statistics.median(decode_step_bytes(runner.model, per_token, c) for c in contexts)
    bandwidth = statistics.median(copy_bandwidth(engine.device, args.copy_mib << 20) for _ in range(3))
    floor = needed / bandwidth
    weights = decode_step_bytes(runner.model, per_token, [])
    print(f"{engine.device} {engine.dtype}, backend {runner.backend.name}, batch {args.batch_size}, "
          f"context {min(contexts[0])}-{max(contexts[-1])} tokens, median of {args.steps} decode steps: "
          f"{step * 1e3:.2f} ms ({args.batch_size / step:.0f} tok/s)")
    print(f"bytes read per step: weights {weights / 1e9:.3f} GB + KV {(needed - weights) / 1e9:.3f} GB = "
          f"{needed / 1e9:.3f} GB")
    print(f"copy bandwidth (read + write) {bandwidth / 1e9:.1f} GB/s -> floor {floor * 1e3:.3g} ms -> "
          f"floor/step {floor / step:.2f}")
    engine.pop_finished_ids()


if __name__ == "__main__":
    main()
