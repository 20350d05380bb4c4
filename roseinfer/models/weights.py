"""Copies checkpoint tensors into a model's parameters, slicing fused (packed) projections.

Embedding tables are the exception on CPU: when the checkpoint's tensor already has the
parameter's dtype, the parameter becomes that tensor, which safetensors memory-maps from the file.
A lookup reads only the rows of the tokens it embeds, so the table does not have to be resident.
A tied table goes further once the LM head is prepacked: the embedding looks its rows up in the
head's packed copy and the table is let go (layers/embedding.py).
Such parameters carry `checkpoint_mapped = True` so the loader can hand their pages back once
prepacking has read them (loader/model_loader.py).
"""
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
        self.mappable = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}

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
        if name in self.mappable and _can_map(param, tensor):
            param.data = tensor
            param.checkpoint_mapped = True
        else:
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


def _can_map(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """The checkpoint tensor can stand in for the parameter as it is: no conversion, no copy."""
    return (param.device.type == "cpu" and tensor.device.type == "cpu" and tensor.dtype == param.dtype
            and tensor.is_contiguous())
