"""The backend boundary: everything that depends on the hardware sits behind `Backend`, chosen once
at engine start (backends/__init__.py). The model runner hands a backend each step's BatchLayout
and gets back the backend's own AttentionMetadata (layers/attention.py), which the models pass to
their attention layers; at load, `prepare_model` may swap faster layers into the model (gpt-fast
swaps quantized linears the same way), so no generic code ever branches on the backend."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import nn

from roseinfer.layers.attention import AttentionMetadata, KVCache
from roseinfer.layers.gated_delta_rule import LinearStateBatch
from roseinfer.layers.linear import Linear
from roseinfer.models.config import ModelConfig
from roseinfer.platforms import platform_for

logger = logging.getLogger(__name__)


@dataclass
class FutureTokens:
    """Overlap scheduling: input ids that the step before is still sampling. Rows `rows` of the flat
    batch take source[indices] on the device, so nothing waits for the host to see them."""

    rows: list[int]
    source: torch.Tensor  # the step before's sampled ids, on the device
    indices: list[int]


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
    # a hybrid model's sequences verifying a draft (by index): the first of the scratch slots their
    # states after each draft position but the last pass through (layers/gated_delta_rule.py DraftPosition)
    draft_scratch: dict[int, int] = field(default_factory=dict)
    future: FutureTokens | None = None

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
        self.platform = platform_for(device)

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
                                                       layout.kv_lens, self.device, self.dtype, layout.draft_scratch)
        return model(self.fill_future(self.tensor(layout.input_ids), layout), self.tensor(layout.positions),
                     kv_caches, meta)

    def fill_future(self, input_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """input_ids (the step's rows first) with the future tokens put in, on the device."""
        future = layout.future
        if future is not None:
            input_ids[self.tensor(future.rows)] = future.source[self.tensor(future.indices)]
        return input_ids

    def capture(self, model: nn.Module, kv_caches: list[KVCache], max_num_seqs: int, max_blocks: int,
                block_size: int) -> None:
        """Once the KV pool exists, record what later steps replay (CUDA graphs of decode steps,
        where the backend has them); the engine skips this with --enforce-eager."""

    def prepare_model(self, model: nn.Module, cpu_activations: str = "auto") -> None:
        """After the weights are loaded (the platform then gives back what loading left behind).
        cpu_activations (EngineConfig's) is the CPU backend's choice; the others have none."""
        self.platform.after_load(model)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy pick over [N, V] logits."""
        return logits.argmax(dim=-1)

    @property
    def mlp_chunk_rows(self) -> int | None:
        return self.platform.mlp_chunk_rows

    @property
    def logits_chunk_rows(self) -> int | None:
        return self.platform.logits_chunk_rows

    def matmul_loop(self, layers: list[Linear], inputs: dict[int, torch.Tensor]) -> Callable[[int], None]:
        """`steps -> None`: that many times, each layer on its input width's activation, in order, as
        the engine's decode step runs them (bench/floor.py times it)."""
        def steps(count: int) -> None:
            for _ in range(count):
                for layer in layers:
                    layer(inputs[layer.in_features])

        return steps

    def tensor(self, values: list) -> torch.Tensor:
        """A step's index list as a tensor on the device (int64); from pinned memory on CUDA, so the host
        does not wait for the queued steps (async scheduling prepares the next one meanwhile)."""
        return self.platform.upload(torch.tensor(values, dtype=torch.long))

