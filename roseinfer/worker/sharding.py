"""Which share of a model each tensor-parallel rank computes, from its config alone: checked before
any process starts, then each rank's config (its heads and MLP width) sizes its backend and pool.
The weights' split itself is distributed/parallel.py's (TensorParallel, as the models build it)."""
from __future__ import annotations

from dataclasses import replace

from roseinfer.models.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A ValueError that says what does not divide, before any worker starts."""
    problems = _uneven(cfg, size)
    if problems:
        fits = [str(n) for n in range(1, cfg.num_heads + 1) if not _uneven(cfg, n)]
        raise ValueError(f"tensor_parallel_size {size} does not split this {cfg.model_type} model evenly: "
                         f"{'; '.join(problems)}. Sizes that do: {', '.join(fits)}")


def _uneven(cfg: ModelConfig, size: int) -> list[str]:
    problems = []
    if cfg.num_heads % size:
        problems.append(f"its {cfg.num_heads} attention heads are not divisible by {size}")
    if cfg.num_kv_heads != cfg.num_heads and cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"its {cfg.num_kv_heads} KV heads neither divide nor are divisible by {size}")
    if cfg.intermediate_size % size:
        problems.append(f"its MLP width ({cfg.intermediate_size}) is not divisible by {size}")
    if cfg.moe is not None:
        for name, width in (("expert", cfg.moe.expert_width), ("shared expert", cfg.moe.shared_expert_width)):
            if width % size:
                problems.append(f"its {name} width ({width}) is not divisible by {size}")
    if cfg.deepseek_moe is not None:
        for name, width in (("expert", cfg.deepseek_moe.expert_size), ("shared experts'", cfg.deepseek_moe.shared_size)):
            if width % size:
                problems.append(f"its {name} width ({width}) is not divisible by {size}")
    if cfg.qk_norm_across_heads and size > 1:
        problems.append("its q/k norms span every head (OLMoE), which no rank holds alone")
    return problems


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as one rank computes it: its attention heads, KV heads and MLP width (what the
    backend and the KV pool are sized by). The vocabulary stays whole: rank 0 gets every logit."""
    if size == 1:
        return cfg
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                   intermediate_size=cfg.intermediate_size // size)
