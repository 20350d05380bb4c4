"""``roseinfer bench throughput``: nano-vllm's offline workload (its bench.py) -- N prompts of random
token ids, input and output lengths drawn uniformly from their ranges, every request generating
exactly its length -- through ``LLM.generate``, and through transformers' own continuous batching
(``ContinuousBatchingManager``, what ``generate_batch`` runs, each request with its own length) in
the same process for comparison. Both get an untimed warm-up first; the engine's CUDA graphs and
HF's are captured before the clock starts.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from roseinfer.platforms import platform_for, resolve_device
from roseinfer.engine_args import add_engine_args, engine_config_from_args
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.llm import LLM

BACKENDS = ("roseinfer", "hf")
WARMUP_PROMPTS = 4


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    backend: str
    seconds: float
    output_tokens: int
    input_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def make_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """nano-vllm's prompts: token ids below min(vocab, 10000), lengths uniform in the ranges."""
    rng = random.Random(seed)
    top = min(vocab_size, 10_000) - 1
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(*input_range))] for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_prompts)])


def _synchronize(device: str) -> None:
    platform_for(torch.device(device)).synchronize()


def run_roseinfer(args: argparse.Namespace, workload: Workload, warmup: Workload) -> ThroughputResult:
    from roseinfer.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    _generate(llm, warmup)
    llm.reset_prefix_cache()  # the timed run computes every prompt
    _synchronize(args.device)
    start = time.perf_counter()
    made = _generate(llm, workload)
    seconds = time.perf_counter() - start
    if made != workload.output_tokens:
        raise RuntimeError(f"roseinfer made {made} tokens where {workload.output_tokens} were asked for")
    del llm
    _release(args.device)
    return ThroughputResult("roseinfer", seconds, made, workload.input_tokens)


def _generate(llm: LLM, workload: Workload) -> int:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    return sum(len(o.token_ids) for o in llm.generate(workload.prompts, params, use_tqdm=False))


def run_hf(args: argparse.Namespace, folder: str, workload: Workload, warmup: Workload) -> ThroughputResult:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from roseinfer.engine.llm_engine import DTYPES

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(args.device).eval()
    # greedy, and no EOS: every request runs to its own max_new_tokens
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(workload.output_lens))
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                          max_generated_length=max(workload.output_lens), num_requests=len(workload.prompts))
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30,
                                                   workload_hints=hints) as manager:
        _hf_generate(manager, warmup)
        _synchronize(args.device)
        start = time.perf_counter()
        made = _hf_generate(manager, workload)
        seconds = time.perf_counter() - start
    del model, manager
    _release(args.device)
    if made != workload.output_tokens:
        raise RuntimeError(f"HF made {made} tokens where {workload.output_tokens} were asked for")
    return ThroughputResult("hf", seconds, made, workload.input_tokens)


def _hf_generate(manager: Any, workload: Workload) -> int:
    ids = {manager.add_request(prompt, max_new_tokens=n) for prompt, n in zip(workload.prompts, workload.output_lens)}
    made = 0
    while ids:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing the requests")
            continue
        if result.is_finished() and result.request_id in ids:
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
            ids.discard(result.request_id)
            made += len(result.generated_tokens)
    return made


def _release(device: str) -> None:
    """Free a finished backend's memory before the next one sizes its KV cache from what is free."""
    gc.collect()
    platform_for(torch.device(device)).empty_cache()


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256, help="requests (default: %(default)s)")
    g.add_argument("--input-len", type=_length_range, default=(100, 1024), metavar="MIN:MAX",
                   help="prompt lengths, uniform in [MIN, MAX] (default: 100:1024, as nano-vllm)")
    g.add_argument("--output-len", type=_length_range, default=(100, 1024), metavar="MIN:MAX",
                   help="output lengths, uniform in [MIN, MAX], EOS ignored (default: 100:1024)")
    g.add_argument("--backend", choices=(*BACKENDS, "both"), default="roseinfer",
                   help="roseinfer, hf (transformers' continuous batching) or both (default: %(default)s)")


def run_throughput_bench(args: argparse.Namespace) -> list[ThroughputResult]:
    from roseinfer.loader.model_loader import load_model_config, resolve_model_folder

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    args.device = resolve_device(args.device)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)  # process-wide: an hf-only run builds no engine to set it
    folder = resolve_model_folder(args.model)
    vocab = load_model_config(folder).vocab_size
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    warmup = make_workload(min(WARMUP_PROMPTS, args.num_prompts), args.input_len, (8, 8), vocab, args.seed + 1)
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    print("=== throughput benchmark ===")
    print(f"Model: {folder}  Device: {args.device}  dtype: {args.dtype}")
    print(f"Requests: {args.num_prompts}, input tokens {workload.input_tokens} "
          f"({args.input_len[0]}-{args.input_len[1]} each), output tokens {workload.output_tokens} "
          f"({args.output_len[0]}-{args.output_len[1]} each)")
    results = []
    for backend in backends:
        result = (run_roseinfer(args, workload, warmup) if backend == "roseinfer"
                  else run_hf(args, str(folder), workload, warmup))
        results.append(result)
        print(f"{backend}: {result.seconds:.2f} s, output {result.output_throughput:.2f} tok/s, "
              f"total {result.total_throughput:.2f} tok/s")
    if len(results) == 2:
        print(f"roseinfer / hf output throughput: {results[0].output_throughput / results[1].output_throughput:.2f}x")
    return results
