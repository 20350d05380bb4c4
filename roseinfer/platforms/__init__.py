"""Hardware platforms (vLLM's `current_platform`): one per device, chosen once at engine start. Generic
code asks its platform, never which device it runs on; attention backends (backends/) sit on top."""
from __future__ import annotations

import functools

import torch

from roseinfer.platforms.base import Platform


def resolve_device(name: str) -> str:
    """`auto` as the device it means here: CUDA when torch sees one, else the CPU."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def platform_for(device: torch.device) -> Platform:
    if device.type == "cuda":
        from roseinfer.platforms.cuda import CudaPlatform

        return CudaPlatform(device)
    if device.type == "cpu":
        from roseinfer.platforms.cpu import CpuPlatform

        return CpuPlatform(device)
    raise ValueError(f"no platform for device {device}: roseinfer runs on cpu and cuda")
