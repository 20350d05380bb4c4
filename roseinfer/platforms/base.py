"""Platform: what depends on the device itself, apart from any attention backend: the default dtype,
the KV pool's memory budget and allocation, host-to-device uploads, synchronization, a rank's
device and process group. One per device, chosen once (platforms/__init__.py platform_for)."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import nn

from roseinfer.config import EngineConfig

# rows of logits per LM-head pass where a platform takes them in pieces, and of prompt logprobs on every
# device (only their entries are kept; a long prompt's whole logits block would be a step's largest tensor)
LOGITS_CHUNK_ROWS = 64


class Platform(ABC):
    name: ClassVar[str]
    default_dtype: ClassVar[torch.dtype]  # dtype auto
    # the forward returns before the device has run it (what async scheduling's auto turns on for)
    runs_ahead: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]]  # attention backend auto's candidates, fastest first

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def mlp_chunk_rows(self) -> int | None:
        """Rows per MLP pass (layers/linear.py in_row_chunks); None: all at once."""
        return None

    @property
    def logits_chunk_rows(self) -> int | None:
        """Rows of logits per LM-head and sampler pass; None: all at once (on CUDA each piece would
        cost a host sync)."""
        return None

    def check(self, world_size: int) -> None:
        """Refuse, with the reason, an engine of world_size ranks that this machine cannot run."""

    @abstractmethod
    def kv_pool_bytes(self, config: EngineConfig, world_size: int, profile: Callable[[], None]) -> int:
        """What one rank's KV pool may take; `profile` runs the largest step where its peak memory counts."""

    def allocate_kv_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The KV pool, allocated once and zeroed: padded and masked key slots still enter the
        attention matmuls, and a NaN bit pattern there would survive a zero weight."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def after_load(self, model: nn.Module) -> None:
        """Once the weights are in: give back what loading left behind."""

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, without blocking the host where the device allows it."""
        return host.to(self.device)

    def synchronize(self) -> None:
        """Wait for the work queued on the device."""

    def empty_cache(self) -> None:
        """Give memory the allocator keeps back to the device (between engines in one process)."""

    def rank_device(self, rank: int) -> torch.device:
        """Tensor-parallel rank `rank`'s device, made current in its process."""
        return self.device

    @abstractmethod
    def process_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        """The ranks' collective group on this device's transport."""

    @contextlib.contextmanager
    def trace_range(self, name: str) -> Iterator[None]:
        """A named range for the device's profiler (nsys on CUDA); nothing elsewhere."""
        yield
