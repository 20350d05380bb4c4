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

from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.distributed.parallel import Part


@dataclass(frozen=True)
class BlockPart:
    """One sub-projection of a fused weight whose parts are GGUF blocks of different types
    (loader/quantized.py): its rows of the output, stored at bytes [offset, offset + nbytes) of the
    parameter."""
    type_id: int
    rows: int
    offset: int
    nbytes: int


class WeightLoader:
    """Under tensor parallelism (distributed/parallel.py) each rank takes its share of a checkpoint
    tensor: a column-parallel layer (`tp_parts`) its rows of each sub-projection, a row-parallel one
    (`tp_input`) its columns, rank 0 alone its bias. At size 1 the parts are whole."""

    def __init__(self, model: nn.Module, packed_modules: dict[str, tuple[str, int]]) -> None:
        self.model = model
        self.packed_modules = packed_modules
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()
        self.loaded_shards: dict[str, int] = {}
        self.mappable = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for source, (packed, shard) in self.packed_modules.items():
            if f".{source}." in name:
                target = name.replace(f".{source}.", f".{packed}.")
                param = self._param(target, name)
                parts = self._owner(target).tp_parts
                self._copy_parts(param, parts, [shard], tensor, name)
                self.loaded_shards[target] = self.loaded_shards.get(target, 0) + 1
                if self.loaded_shards[target] == len(parts):
                    self.loaded.add(target)
                return
        owner = self._owner(name)
        row_split = getattr(owner, "tp_input", None)
        if row_split is not None and name.endswith(".bias") and owner.bias is None:
            return  # a row-parallel bias: rank 0 adds it
        param = self._param(name, name)
        parts = getattr(owner, "tp_parts", None)
        if parts is not None and not self._whole(parts):
            if name in self.mappable and _fits(parts[0]) and _can_map(param, tensor):
                tensor = tensor.narrow(0, parts[0].start, parts[0].rows)  # its rows of the table, still mapped
            else:  # a fused tensor whose parts this rank slices (GPT-2's c_attn), or a padded last slice
                self._copy_parts(param, parts, range(len(parts)), tensor, name)
                self.loaded.add(name)
                return
        if row_split is not None and name.endswith(".weight") and not self._whole([row_split]):
            tensor = tensor.narrow(1, row_split.start, row_split.rows)  # (a whole one may hold GGUF blocks)
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        if name in self.mappable and _can_map(param, tensor):
            param.data = tensor
            param.checkpoint_mapped = True
        else:
            param.data.copy_(tensor)
        self.loaded.add(name)

    def _copy_parts(self, param: torch.Tensor, parts: list[Part], shards: range | list[int], tensor: torch.Tensor,
                    name: str) -> None:
        """`tensor` is the checkpoint's sub-projections `shards` one after another (one of a fused
        layer's, or all of them); each goes to its place in param, this rank's rows of it only."""
        block_parts = getattr(param, "block_parts", None)
        if block_parts is not None:  # sub-projections in GGUF blocks of different types (loader/quantized.py)
            self._copy_block_parts(param, [block_parts[s] for s in shards], tensor, name)
            return
        expected = sum(parts[s].size for s in shards)
        if tensor.shape[0] != expected or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {(expected, *param.shape[1:])}")
        source = 0  # the sub-projection's first row in tensor
        for s in shards:
            part = parts[s]
            local = sum(p.rows for p in parts[:s])  # its first row in param
            rows = max(0, min(part.rows, part.size - part.start))  # a vocabulary's last slice may run past it
            param.data.narrow(0, local, rows).copy_(tensor.narrow(0, source + part.start, rows))
            param.data.narrow(0, local + rows, part.rows - rows).zero_()
            source += part.size

    @staticmethod
    def _copy_block_parts(param: torch.Tensor, block_parts: list[BlockPart], tensor: torch.Tensor, name: str) -> None:
        """`tensor` is these parts' blocks one after another; each goes to its bytes of param."""
        data = tensor.reshape(-1)
        if data.numel() != sum(part.nbytes for part in block_parts):
            raise ValueError(f"checkpoint tensor {name} has {data.numel()} bytes of blocks, the model expects "
                             f"{sum(part.nbytes for part in block_parts)}")
        source = 0
        for part in block_parts:
            param.data.narrow(0, part.offset, part.nbytes).copy_(data.narrow(0, source, part.nbytes))
            source += part.nbytes

    @staticmethod
    def _whole(parts: list[Part]) -> bool:
        return len(parts) == 1 and parts[0].start == 0 and parts[0].rows == parts[0].size

    def _owner(self, param_name: str) -> nn.Module:
        return self.modules.get(param_name.rpartition(".")[0], self.model)

    def _param(self, target: str, source: str) -> nn.Parameter:
        if target not in self.params:
            raise ValueError(f"checkpoint tensor {source} matches no model parameter")
        return self.params[target]

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")


def _fits(part: Part) -> bool:
    """The part's rows all lie inside the checkpoint tensor (no padding)."""
    return part.start + part.rows <= part.size


def _can_map(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """The checkpoint tensor (in host memory) can stand in for the parameter as it is: no conversion, no copy."""
    return param.device == tensor.device and tensor.dtype == param.dtype and tensor.is_contiguous()
