"""The CUDA platform: budgets from --gpu-memory-utilization after a profiling step, pinned uploads,
one GPU per tensor-parallel rank over NCCL."""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from roseinfer.config import EngineConfig
from roseinfer.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16
    runs_ahead = True
    backends = ("triton", "torch")

    def check(self, world_size: int) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {world_size} needs a GPU per rank; "
                             f"torch sees {torch.cuda.device_count()}")

    def kv_pool_bytes(self, config: EngineConfig, world_size: int, profile: Callable[[], None]) -> int:
        """What --gpu-memory-utilization leaves of this GPU once the weights are in and `profile` has
        run the largest step (its activations' peak)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        profile()
        torch.cuda.synchronize(self.device)
        total = torch.cuda.mem_get_info(self.device)[1]
        return int(total * config.gpu_memory_utilization - torch.cuda.max_memory_allocated(self.device))

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory().to(self.device, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def rank_device(self, rank: int) -> torch.device:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device

    def process_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)

    @contextlib.contextmanager
    def trace_range(self, name: str) -> Iterator[None]:
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
