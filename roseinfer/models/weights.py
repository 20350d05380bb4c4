"""Copies checkpoint tensors into a model's parameters, slicing fused (packed) projections."""
from __future__ import annotations

import torch
from torch import nn


class WeightLoader:
    def __init__(self, model: nn.Module, packed_modules: dict[str, tuple[str, int]]) -> None:
        self.model = model
        self.packed_modules = packed_modules
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.loaded_shards: dict[str, int] = {}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for source, (packed, shard) in self.packed_modules.items():
            if f".{source}." in name:
                target = name.replace(f".{source}.", f".{packed}.")
                param = self._param(target, name)
                sizes = self.model.shard_sizes(packed)
                start = sum(sizes[:shard])
                param.data.narrow(0, start, sizes[shard]).copy_(tensor)
                self.loaded_shards[target] = self.loaded_shards.get(target, 0) + 1
                if self.loaded_shards[target] == len(sizes):
                    self.loaded.add(target)
                return
        param = self._param(name, name)
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        param.data.copy_(tensor)
        self.loaded.add(name)

    def _param(self, target: str, source: str) -> nn.Parameter:
        if target not in self.params:
            raise ValueError(f"checkpoint tensor {source} matches no model parameter")
        return self.params[target]

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
