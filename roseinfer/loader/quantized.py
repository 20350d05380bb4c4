"""GGUF weights kept in their blocks (--quantization gguf): which of a model's weights hold blocks,
and the rest dequantized as the checkpoint is read.

A folder converted with keep_blocks (loader/gguf.py) stores some matrices as uint8 rows of blocks
and names them in QUANTIZATION_FILE. A weight keeps its blocks where the backend computes with that
type (Backend.quantized_types) and the weight is a linear's or an embedding's; a fused weight
(q/k/v, gate/up) where every part is stored as blocks of such a type. The parameter becomes uint8
[rows, bytes per row] with the type on it (`ggml_type`); a fused weight whose parts differ in type
(a Q4_K_M file's Q4_K q/k and Q6_K v) becomes its parts' blocks back to back, uint8 [bytes], with
`block_parts` (BlockPart, one per sub-projection) on it, each part computed by its own type's
kernel into its rows of the output. The backend's layers read them (backends/cpu/quantized.py).
Every other stored block tensor is dequantized on the way in, exactly as the fp32 conversion would
have. Stacked experts (models/moe.py) keep theirs as [experts, rows, bytes per row] where gate and
up share a type (`keep_expert_blocks`)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from roseinfer.layers.linear import Linear
from roseinfer.loader.gguf import QUANTIZATION_FILE
from roseinfer.models.moe import StackedExperts
from roseinfer.models.weights import BlockPart

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockTensor:
    """A checkpoint tensor stored as GGUF blocks: its type and its dense shape ([rows, cols], or
    [experts, rows, cols] for stacked experts)."""
    qtype: str
    shape: tuple[int, ...]

    @property
    def type_id(self) -> int:
        from gguf import GGMLQuantizationType

        return int(GGMLQuantizationType[self.qtype])


def block_tensors(folder: Path) -> dict[str, BlockTensor]:
    """The folder's tensors stored as blocks, by checkpoint name; empty for a plain folder."""
    path = folder / QUANTIZATION_FILE
    if not path.is_file():
        return {}
    tensors = json.loads(path.read_text())["tensors"]
    return {name: BlockTensor(t["type"], tuple(t["shape"])) for name, t in tensors.items()}


def keep_blocks(model: nn.Module, stored: dict[str, BlockTensor], types: frozenset[str]) -> set[str]:
    """Turns the weights that keep their blocks into uint8 parameters (tied modules share the new one)
    and returns the checkpoint names they are loaded from; the other stored names get dequantized."""
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    sources: dict[str, list[str]] = {}  # model weight -> its checkpoint tensors
    for name in stored:
        target = name
        for source, (fused, _) in packed.items():
            target = target.replace(f".{source}.", f".{fused}.")
        sources.setdefault(target, []).append(name)
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    kept = keep_expert_blocks(modules, stored, types)
    for target, names in sources.items():
        if target not in params:  # a name the model renames or skips (GPT-2's, a tied head): fp32
            continue
        module = modules.get(target.rpartition(".")[0])
        qtypes = {stored[name].qtype for name in names}
        fused = len(names) > 1 or target not in names
        if not isinstance(module, (Linear, nn.Embedding)) or not target.endswith(".weight"):
            continue
        parts = len(module.tp_parts) if fused else 1  # a fused projection's sub-projections
        if len(names) != parts:
            logger.info("%s stays fp32: one matmul reads its parts, some stored as fp32", target)
            continue
        if not qtypes <= types:
            continue
        old = module.weight
        if len(qtypes) == 1:
            row_bytes = _row_bytes(qtypes.pop(), old.shape[1])
            param = nn.Parameter(torch.empty(old.shape[0], row_bytes, dtype=torch.uint8, device=old.device),
                                 requires_grad=False)
            param.ggml_type = stored[names[0]].type_id
        else:
            param = _parts_parameter(module, [stored[name] for name in _by_shard(names, packed)], old.device)
        for other in model.modules():
            if getattr(other, "weight", None) is old:
                other.weight = param
        kept.update(names)
    return kept


def keep_expert_blocks(modules: dict[str, nn.Module], stored: dict[str, BlockTensor], types: frozenset[str]) -> set[str]:
    """keep_blocks for stacked experts (models/moe.py): gate/up [E, 2 w, bytes] where gate and up
    share a type, down [E, H, bytes], each expert's rows contiguous; returns the names kept."""
    kept: set[str] = set()
    for prefix, module in modules.items():
        if not isinstance(module, StackedExperts):
            continue
        parts = {"gate_up_proj": [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"],
                 "down_proj": [f"{prefix}.down_proj.weight"]}
        for target, names in parts.items():
            qtypes = {stored[name].qtype for name in names if name in stored}
            if not all(name in stored for name in names) or len(qtypes) != 1:
                continue
            qtype = qtypes.pop()
            if qtype not in types:
                continue
            old = getattr(module, target)
            experts, rows, cols = old.shape
            param = nn.Parameter(torch.empty(experts, rows, _row_bytes(qtype, cols), dtype=torch.uint8,
                                             device=old.device), requires_grad=False)
            param.ggml_type = stored[names[0]].type_id
            setattr(module, target, param)
            kept.update(names)
    return kept


def _by_shard(names: list[str], packed: dict[str, tuple[str, int]]) -> list[str]:
    """A fused weight's checkpoint names in the order of its sub-projections."""
    def shard(name: str) -> int:
        return next(index for source, (_, index) in packed.items() if f".{source}." in name)

    return sorted(names, key=shard)


def _parts_parameter(module: Linear, parts: list[BlockTensor], device: torch.device) -> nn.Parameter:
    """uint8 [bytes] for the parts' blocks back to back, with `block_parts` saying where each lies."""
    block_parts, offset = [], 0
    for part, tensor in zip(module.tp_parts, parts):
        nbytes = part.rows * _row_bytes(tensor.qtype, module.in_features)
        block_parts.append(BlockPart(tensor.type_id, part.rows, offset, nbytes))
        offset += nbytes
    param = nn.Parameter(torch.empty(offset, dtype=torch.uint8, device=device), requires_grad=False)
    param.block_parts = block_parts
    return param


def _row_bytes(qtype: str, cols: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return cols // block * size


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], stored: dict[str, BlockTensor],
                kept: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, those stored as blocks but not kept dequantized to fp32 (gguf-py's
    dequantize: the values the fp32 conversion writes)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for name, tensor in weights:
        if name in stored and name not in kept:
            values = dequantize(tensor.numpy(), GGMLQuantizationType[stored[name].qtype])
            tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(stored[name].shape))
        yield name, tensor
