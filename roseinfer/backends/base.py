"""The backend boundary: everything that depends on the hardware sits behind `Backend`, chosen once
at engine start (backends/__init__.py). The model runner hands a backend each step's BatchLayout
and gets back the backend's own AttentionMetadata (layers/attention.py), which the models pass to
their attention layers; at load, `prepare_model` may swap faster layers into the model (gpt-fast
swaps quantized linears the same way), so no generic code ever branches on the backend."""
from __future__ import annotations

import logging
import math
import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.layers.attention import AttentionMetadata, KVCache
from roseinfer.layers.gated_delta_rule import LinearStateBatch
from roseinfer.layers.linear import Linear
from roseinfer.models.config import ModelConfig

logger = logging.getLogger(__name__)

MLP_CHUNK_ROWS = 512  # CPU: rows per MLP pass (see Backend.mlp_chunk_rows)
LOGITS_CHUNK_ROWS = 64  # CPU: rows of logits per LM-head pass (see Backend.logits_chunk_rows)


@dataclass
class BatchLayout:
    """One step's flat batch as the model runner lays it out (host lists, one entry per token or per
    scheduled sequence); a backend turns it into its metadata's tensors once per step."""

    block_size: int
    input_ids: list[int]  # per token
    positions: list[int]  # per token: its position in its sequence
    slot_mapping: list[int]  # per token: its cache slot
    q_starts: list[int]  # per sequence: its first row of the flat batch
    q_lens: list[int]  # per sequence: its rows this step (1 for a decode)
    kv_lens: list[int]  # per sequence: its context once this step's tokens are cached
    block_tables: list[list[int]]  # per sequence: its cache blocks, in order
    state_slots: list[int] = field(default_factory=list)  # per sequence of a hybrid model: its state pool slot

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)


class Backend(ABC):
    """Hardware-specific behaviour of one engine: attention metadata, layer swaps, the KV pool."""

    name: ClassVar[str]
    # GGUF block types its layers compute with in place (loader/quantized.py); others get fp32 weights
    quantized_types: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, device: torch.device, dtype: torch.dtype, model_config: ModelConfig,
                 world_size: int = 1) -> None:
        self.device = device
        self.dtype = dtype
        self.model_config = model_config  # one rank's share of the model under tensor parallelism
        self.world_size = world_size  # tensor-parallel ranks: layers that reach across them are off limits

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend can run tensors of this device and dtype here."""
        return True

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """The step's metadata, shared by every layer's attention."""

    def forward(self, model: nn.Module, layout: BatchLayout, kv_caches: list[KVCache]) -> torch.Tensor:
        """One forward over the step's flat batch; returns the hidden states, a row per token."""
        meta = self.build_metadata(layout)
        if layout.state_slots:
            meta.linear_state = LinearStateBatch.build(layout.state_slots, layout.q_starts, layout.q_lens,
                                                       layout.kv_lens, self.device, self.dtype)
        return model(self.tensor(layout.input_ids), self.tensor(layout.positions), kv_caches, meta)

    def capture(self, model: nn.Module, kv_caches: list[KVCache], max_num_seqs: int, max_blocks: int,
                block_size: int) -> None:
        """Once the KV pool exists, record what later steps replay (CUDA graphs of decode steps,
        where the backend has them); the engine skips this with --enforce-eager."""

    def prepare_model(self, model: nn.Module) -> None:
        """After the weights are loaded. On CPU: glibc keeps much of what loading freed, and an
        embedding table read through the checkpoint's memory map (models/weights.py) holds pages
        that lookups will fault back in; both are handed back."""
        if self.device.type == "cpu":
            from roseinfer.backends.cpu.memory import drop_mapped_pages, return_freed_memory

            return_freed_memory()
            drop_mapped_pages(model)

    def kv_pool_bytes(self, config: EngineConfig, profile: Callable[[], None]) -> int:
        """What the KV pool may take. On CUDA: what --gpu-memory-utilization leaves of the GPU once the
        weights are in and `profile` has run the largest step (its activations' peak); on a CPU:
        --kv-cache-memory-gb, else 1 GiB or 10 % of RAM, whichever is less (the pool is written
        whole at startup, and a laptop runs other things too). With tensor parallelism that CPU budget
        is the engine's, shared by its ranks' pools (each holding its KV heads); a GPU's is per GPU."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            profile()
            torch.cuda.synchronize(self.device)
            total = torch.cuda.mem_get_info(self.device)[1]
            return int(total * config.gpu_memory_utilization - torch.cuda.max_memory_allocated(self.device))
        if config.kv_cache_memory_gb is not None:
            return int(config.kv_cache_memory_gb * 2**30) // self.world_size
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(min(2**30, 0.1 * ram)) // self.world_size

    def allocate_kv_pool(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The KV pool, allocated once and zeroed: padded and masked key slots still enter the
        attention matmuls, and a NaN bit pattern there would survive a zero weight."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return _resident_cpu_pool(shape, self.dtype)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy pick over [N, V] logits."""
        return logits.argmax(dim=-1)

    @property
    def mlp_chunk_rows(self) -> int | None:
        """Rows per MLP pass. On CPU a prefill step's widest tensors are the MLP's intermediates
        (25 MB of the default model's 2048-token step), and the allocator (glibc, jemalloc and
        tcmalloc alike) keeps what a step touched, so in 512-row pieces a batch-64 run peaked 32 MiB
        lower with prefill unchanged. CUDA's caching allocator reuses its blocks: no pieces."""
        return MLP_CHUNK_ROWS if self.device.type == "cpu" else None

    @property
    def logits_chunk_rows(self) -> int | None:
        """Rows of logits per LM-head pass. On CPU at batch 256 the whole [256, 49152] block was a
        50 MB transient that set the process's peak; at 64 rows the head stays as fast. CUDA keeps
        one pass: each piece would cost a host sync."""
        return LOGITS_CHUNK_ROWS if self.device.type == "cpu" else None

    def matmul_loop(self, layers: list[Linear], inputs: dict[int, torch.Tensor]) -> Callable[[int], None]:
        """`steps -> None`: that many times, each layer on its input width's activation, in order, as
        the engine's decode step runs them (bench/floor.py times it)."""
        def steps(count: int) -> None:
            for _ in range(count):
                for layer in layers:
                    layer(inputs[layer.in_features])

        return steps

    def tensor(self, values: list) -> torch.Tensor:
        """A step's index list as a tensor on the device (int64)."""
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _resident_cpu_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A private anonymous mmap in 2 MB pages where the kernel allows (transparent huge pages,
    "madvise" mode): decode attention reads K/V blocks scattered over the whole pool, and with 4 KB
    pages their address translations miss the TLB and push out the matmuls' own (a paired run took
    146 against 152 ms a step at batch 64). Every page is written once here, so the pool is
    resident before the first request, as vLLM's and llama.cpp's are: left to first touch, the
    faults landed in serving (~30 ms more at each block boundary at batch 16), and a pool too large
    for the machine shows at startup, not in the middle of serving."""
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        buffer.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping alive
    return pool.zero_()  # already zeros: the write commits every page now, on torch's threads
