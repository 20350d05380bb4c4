"""The CPU platform: RAM budgets, a resident KV pool in huge pages, memory given back after loading,
work done in row pieces so the allocator's peak stays low."""
from __future__ import annotations

import math
import mmap
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.platforms import base
from roseinfer.platforms.base import Platform
from roseinfer.platforms.cpu_memory import drop_mapped_pages, return_freed_memory

MLP_CHUNK_ROWS = 512


class CpuPlatform(Platform):
    name = "cpu"
    default_dtype = torch.float32
    backends = ("cpu", "torch")

    @property
    def mlp_chunk_rows(self) -> int:
        """A prefill step's widest tensors are the MLP's intermediates, and the allocator (glibc,
        jemalloc and tcmalloc alike) keeps what a step touched: in pieces the peak stays low, prefill
        as fast (docs/profiling.md)."""
        return MLP_CHUNK_ROWS

    @property
    def logits_chunk_rows(self) -> int:
        """A large batch's whole logits block would set the process's peak; in pieces the head stays
        as fast (docs/profiling.md)."""
        return base.LOGITS_CHUNK_ROWS

    def kv_pool_bytes(self, config: EngineConfig, world_size: int, profile: Callable[[], None]) -> int:
        """--kv-cache-memory-gb, else 1 GiB or 10 % of RAM, whichever is less (the pool is written
        whole at startup, and a laptop runs other things too); shared by the tensor-parallel ranks'
        pools (each holding its KV heads)."""
        if config.kv_cache_memory_gb is not None:
            return int(config.kv_cache_memory_gb * 2**30) // world_size
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(min(2**30, 0.1 * ram)) // world_size

    def allocate_kv_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A private anonymous mmap in 2 MB pages where the kernel allows (transparent huge pages,
        "madvise" mode): decode attention reads K/V blocks scattered over the whole pool, and with 4 KB
        pages their address translations miss the TLB and push out the matmuls' own. Every page is
        written once here, so the pool is resident before the first request, as vLLM's and
        llama.cpp's are, and a pool too large for the machine shows at startup, not while serving."""
        numel = math.prod(shape)
        buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
            buffer.madvise(mmap.MADV_HUGEPAGE)
        pool = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping alive
        return pool.zero_()  # already zeros: the write commits every page now, on torch's threads

    def after_load(self, model: nn.Module) -> None:
        """glibc keeps much of what loading freed, and an embedding table read through the
        checkpoint's memory map (models/weights.py) holds pages that lookups will fault back in."""
        return_freed_memory()
        drop_mapped_pages(model)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def process_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
