"""Backends, chosen once at engine start by `--attention-backend` (EngineConfig.attention_backend).

auto picks `cpu` for fp32 on a CPU where the C kernels build, `triton` on CUDA, else `torch` (the
reference, on any device; also the way to run without any of the CPU kernels).
"""
from __future__ import annotations

import logging

import torch

from roseinfer.backends.base import Backend
from roseinfer.config import BACKEND_NAMES
from roseinfer.models.config import ModelConfig
from roseinfer.platforms import platform_for

logger = logging.getLogger(__name__)


def backend_class(name: str) -> type[Backend]:
    if name == "torch":
        from roseinfer.backends.torch_sdpa import TorchBackend

        return TorchBackend
    if name == "cpu":
        from roseinfer.backends.cpu import CPUBackend

        return CPUBackend
    if name == "triton":
        from roseinfer.backends.triton import TritonBackend

        return TritonBackend
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def select_backend(name: str, device: torch.device, dtype: torch.dtype, model_config: ModelConfig,
                   world_size: int = 1) -> Backend:
    """The backend `name` for this device and dtype; `auto` picks the fastest that runs here.
    model_config is what one rank computes (worker/sharding.py shard_config) and world_size the
    number of tensor-parallel ranks, each with a backend of its own."""
    if name == "auto":
        name = next(c for c in platform_for(device).backends if backend_class(c).supports(device, dtype))
        logger.info("attention backend: %s", name)
    cls = backend_class(name)
    if not cls.supports(device, dtype):
        raise ValueError(f"the {name} backend cannot run {dtype} on {platform_for(device).name} here")
    return cls(device, dtype, model_config, world_size)
