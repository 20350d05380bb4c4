"""Engine configuration: one dataclass, vLLM's names where they exist, validated once."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

ADMISSION_POLICIES = ("fifo", "pack")
BACKEND_NAMES = ("auto", "torch", "cpu", "triton")  # backends/__init__.py
SPECULATIVE_METHODS = ("ngram", "draft_model")
QUANTIZATION_METHODS = ("auto", "gguf", "none")  # loader/quantized.py
CPU_ACTIVATIONS = ("auto", "fp32", "int8")  # backends/cpu/quantized.py
SWITCHES = ("auto", "on", "off")  # engine_process (engine_client/select.py), async_scheduling


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's names): a proposer guesses the next tokens and one forward of
    the target verifies them, so a step can emit several tokens."""

    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    model: str | None = None  # draft_model: a folder or hub id with the target's vocabulary
    num_speculative_tokens: int = 4  # K: tokens proposed per step
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    # no speculation in steps with more running decodes than this: each verification row costs its
    # own attention and widens the step's matmuls, so beyond one sequence it stops paying on a CPU
    # (docs/profiling.md)
    disable_by_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"speculative_config: {name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs a model, and only it takes one")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder, GGUF file or hub id; None = the embedded default
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: CUDA when torch sees one, else the CPU
    seed: int = 0
    max_model_len: int | None = None  # None = the model's context length
    num_threads: int | None = None  # CPU intra-op threads; None = torch's default
    # ranks the model is split over, one process each (distributed/); a CPU's threads are shared by them
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # the hardware backend, attention and the layers it swaps in (backends/)
    # GGUF matrices kept in their blocks, dequantized inside the matmul: gguf (an error where the backend
    # cannot), auto (gguf where it can, else fp32), none (fp32 at load)
    quantization: str = "auto"
    # how the cpu backend multiplies GGUF blocks: fp32 rows of x (exact on the dequantized weights), or
    # rows quantized to 8 bits with integer dot products (llama.cpp's numerics); auto: fp32
    cpu_activations: str = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    # sampling defaults for requests that leave a field unset (loader/generation_config.py)
    generation_config: str = "auto"  # auto: the model's generation_config.json; vllm: none; else a folder
    override_generation_config: dict[str, Any] | None = None  # generation_config.json keys that win
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = sized from kv_cache_memory_gb / gpu_memory_utilization
    kv_cache_memory_gb: float | None = None  # CPU budget for the pool; None = min(1 GiB, 10% of RAM)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    prefill_max_batch_size: int | None = None  # new requests admitted per step
    prefill_max_tokens: int | None = None  # prompt tokens computed per step
    prefill_admission_policy: str = "fifo"
    pack_lookahead: int = 64  # waiting requests considered by the pack policy
    pack_fifo_every: int = 8  # starvation guard: every Nth admitting step is FIFO
    decode_first: bool = False
    # schedule the next step while the current one's forward runs (engine/core.py); auto: where the
    # device runs ahead of the host (CUDA), not on a CPU, whose forward returns when it is done
    async_scheduling: str = "auto"
    max_active_requests: int | None = None  # admitted (running) requests at once
    # a dict or JSON object of SpeculativeConfig's fields; None = no speculation
    speculative_config: dict[str, Any] | None = None
    # serving: the engine core in a process of its own (on), in a thread of the server's (off), or as
    # engine_client/select.py decides (auto); the offline LLM steps the core in the caller's thread
    engine_process: str = "auto"

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "pack_lookahead", "pack_fifo_every",
                    "tensor_parallel_size")
        optional_positive = ("num_kv_blocks", "prefill_max_batch_size", "prefill_max_tokens",
                             "max_active_requests", "max_model_len", "num_threads")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.prefill_admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"prefill_admission_policy must be one of {ADMISSION_POLICIES}, "
                             f"got {self.prefill_admission_policy!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError("quantization gguf keeps GGUF blocks whole, and tensor parallelism splits weights "
                             "through them: use quantization auto (or none), which dequantizes at load")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, "
                             f"got {self.cpu_activations!r}")
        if self.engine_process not in SWITCHES:
            raise ValueError(f"engine_process must be one of {', '.join(SWITCHES)}, "
                             f"got {self.engine_process!r}")
        if self.async_scheduling not in SWITCHES:
            raise ValueError(f"async_scheduling must be one of {', '.join(SWITCHES)}, got {self.async_scheduling!r}")
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        self.speculative  # noqa: B018 -- validated here, once, so a bad config fails at construction

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (a JSON string is accepted too); None = no speculation."""
        value = self.speculative_config
        if value is None:
            return None
        return SpeculativeConfig.from_dict(json.loads(value) if isinstance(value, str) else value)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)


def prefill_step_tokens(max_num_batched_tokens: int, prefill_max_tokens: int | None) -> int:
    """The most prompt tokens one engine step computes: the step's token budget, or the prefill
    cap where that is lower."""
    return min(max_num_batched_tokens, prefill_max_tokens or max_num_batched_tokens)

