"""Mixture-of-experts families on the Llama layer stack: Qwen2-MoE (a shared expert behind a sigmoid
gate), Qwen3-MoE (q/k norm per head), Mixtral (Mistral's attention), OLMoE (q/k norm across heads,
clipped q/k/v). A decoder layer reads norm -> attention -> norm -> MLP, the MLP being models/moe.py's
SparseMoeBlock, or a dense one in the layers `MoeLayout.sparse_layers` leaves out (Qwen's
`mlp_only_layers`, `decoder_sparse_step`).

Checkpoints name each expert's projections separately (`mlp.experts.3.gate_proj`, Mixtral's
`block_sparse_moe.experts.3.w1`); transformers 5 in memory and GGUF files stack them
(`mlp.experts.gate_up_proj` [E, 2 w, H], `mlp.experts.gate_proj` [E, w, H]). Each goes into the
layer's stacked parameters (StackedExperts.load).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from roseinfer.distributed.parallel import TensorParallel
from roseinfer.models.config import ModelConfig
from roseinfer.models.llama import DecoderForCausalLM, LlamaDecoderLayer, LlamaMLP
from roseinfer.models.moe import EXPERT_PROJECTIONS, SparseMoeBlock
from roseinfer.models.weights import WeightLoader

# model.layers.{layer}.mlp.experts[.{expert}].{projection}[.weight]
_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(\w+?)(?:\.weight)?$")


class MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> nn.Module:
        if layer in cfg.moe.sparse_layers:
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp)
        return LlamaMLP(cfg, tp)


class MoeForCausalLM(DecoderForCausalLM):
    layer_class = MoeDecoderLayer

    def load_weight(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the layer's MLP
        if not load_expert_weight(self.model.layers, loader, name, tensor):
            super().load_weight(loader, name, tensor)


def load_expert_weight(layers: nn.ModuleList, loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """One checkpoint tensor into its layer's stacked experts (models/moe.py StackedExperts) if it is
    an expert's; False, loading nothing, for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return False
    layer, expert, projection = match.groups()
    experts = layers[int(layer)].mlp.experts
    prefix = f"model.layers.{layer}.mlp.experts"
    if projection == "gate_up_proj":  # transformers 5's stacked [E, 2 w, H]: gate rows, then up rows
        gate, up = tensor.chunk(2, dim=-2)
        experts.load("gate_proj", None, gate)
        projection, tensor = "up_proj", up
    if projection not in EXPERT_PROJECTIONS:
        raise ValueError(f"checkpoint tensor {name} matches no model parameter")
    if experts.load(projection, None if expert is None else int(expert), tensor):
        loader.loaded.add(f"{prefix}.{EXPERT_PROJECTIONS[projection][0]}")
    return True
