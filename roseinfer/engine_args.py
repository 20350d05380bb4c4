"""Command-line flags for every EngineConfig field, shared by all subcommands that build an engine."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

from roseinfer.config import (ADMISSION_POLICIES, BACKEND_NAMES, CPU_ACTIVATIONS, QUANTIZATION_METHODS, SWITCHES,
                              EngineConfig)

HELP = {
    "model": "HF folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "auto (default: bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16",
    "device": "auto (default: CUDA when torch sees one, else the CPU), cpu or cuda",
    "seed": "seed of the engine's sampling generator (requests may also carry their own)",
    "max_model_len": "context length cap (default: the model's)",
    "num_threads": "torch CPU threads (default: torch's choice); with --tensor-parallel-size N each rank takes "
                   "1/N of them",
    "tensor_parallel_size": "split the model over N ranks, one process each (torch.distributed: gloo on CPU, "
                            "NCCL on CUDA, one GPU per rank); N must divide the attention heads",
    "attention_backend": "the hardware backend: its attention and the layers it swaps in. cpu: C kernels that "
                         "read the paged cache in place, oneDNN-prepacked linears, a decode step's layers in one "
                         "C call (fp32); triton: Triton kernels (CUDA); torch: torch ops only, any device (the "
                         "reference, and the switch to run without any kernel of ours); auto (default): cpu on "
                         "a CPU where the kernels build, triton on CUDA, else torch",
    "quantization": "GGUF models: gguf keeps Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrices in their blocks "
                    "and dequantizes them inside the matmul (cpu backend; an error on one that cannot); none "
                    "dequantizes every tensor to fp32 at load; auto (default): gguf where the backend can, else fp32",
    "cpu_activations": "cpu backend, GGUF blocks kept (--quantization gguf/auto): fp32 multiplies them by fp32 rows "
                       "(exact on the dequantized weights); int8 quantizes each row of x to 8 bits (Q8_K for "
                       "Q4_K/Q5_K/Q6_K, Q8_0 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1) and multiplies with integer dot products, "
                       "as llama.cpp does (faster, not exact: docs/quantization.md); auto (default): fp32",
    "enforce_eager": "CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start-up",
    "generation_config": "sampling defaults for request fields left unset: auto (the model's "
                         "generation_config.json, where it has one), vllm (none: the API's defaults), or a folder "
                         "holding a generation_config.json",
    "override_generation_config": "JSON of generation_config.json keys that win over the model's, e.g. "
                                  "'{\"temperature\": 0.7, \"max_new_tokens\": 512}' (temperature, top_p, top_k, "
                                  "min_p, repetition_penalty, max_new_tokens) (default: none)",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool size in blocks (default: sized from memory)",
    "kv_cache_memory_gb": "CPU memory for the KV pool when --num-kv-blocks is not given "
                          "(default: 1 GiB or 10%% of RAM, whichever is less)",
    "gpu_memory_utilization": "fraction of GPU memory for weights + KV pool",
    "enable_prefix_caching": "reuse cached KV blocks of shared prefixes",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (decodes + prefill chunks)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "prefill_max_batch_size": "most new requests admitted per step (default: no limit)",
    "prefill_max_tokens": "most prompt tokens computed per step (default: the step's token budget)",
    "prefill_admission_policy": "fifo, or pack (smallest prompts first within a lookahead window)",
    "pack_lookahead": "waiting requests the pack policy looks at",
    "pack_fifo_every": "pack's starvation guard: every Nth admitting step is FIFO",
    "decode_first": "alternate decode-only and prefill-only steps instead of mixing them",
    "async_scheduling": "overlap scheduling: schedule and prepare the next step while the current one's forward "
                        "and sampling run, its sampled ids fed to the next on the device; off for steps with "
                        "structured output, penalties, top-k/top-p/min-p sampling or prompt logprobs, and with "
                        "speculative decoding or tensor parallelism; auto (default): on for CUDA, off on a CPU",
    "max_active_requests": "most admitted (running) requests at once (default: no limit)",
    "speculative_config": "JSON of speculative decoding settings (vLLM's names), e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4, "
                          "\"disable_by_batch_size\": 1}', or '{\"model\": DRAFT, \"num_speculative_tokens\": 4}' "
                          "for a draft model with the target's vocabulary (default: none)",
    "engine_process": "run the engine core (scheduler, forward, sampler) in a process of its own, the caller's "
                      "process keeping HTTP, detokenization and stop strings (on), or in a thread of the caller's "
                      "process (off); auto (default): on for serve, off for LLM and bench throughput",
}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                    names: dict[str, tuple[str, ...]] | None = None) -> None:
    """Add a flag per EngineConfig field except those in `skip` (a subcommand's own flag of that name
    wins); `names` gives a field other option strings (the benchmarks' blog names), dest unchanged."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flags = (names or {}).get(f.name, ("--" + f.name.replace("_", "-"),))
        default = f.default
        if f.type in ("bool", bool):
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=HELP[f.name])
            continue
        kind = {"int": int, "int | None": int, "float": float, "float | None": float,
                "dict[str, Any] | None": _json_object}.get(str(f.type), str)
        choices = {"prefill_admission_policy": ADMISSION_POLICIES, "attention_backend": BACKEND_NAMES,
                   "quantization": QUANTIZATION_METHODS, "cpu_activations": CPU_ACTIVATIONS,
                   "engine_process": SWITCHES, "async_scheduling": SWITCHES}.get(f.name)
        # a help text that explains its own default (None rarely says what happens) keeps it
        shown = "" if "(default" in HELP[f.name] else f" (default: {default})"
        group.add_argument(*flags, dest=f.name, type=kind, default=default, choices=choices,
                           help=HELP[f.name] + shown)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"temperature\": 0.7}'")
    return value


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return EngineConfig(**values)
