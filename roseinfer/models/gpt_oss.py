"""gpt-oss: the Llama layer stack with q/k/v/o biases, a learned sink per query head in every
attention softmax (layers/attention.py), sliding and full layers alternating (`layer_types`), YaRN
rotary, and a mixture of experts in every layer: a router with a bias, softmax over each token's
top-k logits, experts with biases and the clamped SwiGLU (layers/activation.py ClampedSwigluAndMul),
computed by models/moe.py's StackedExperts.

Checkpoints hold the experts as transformers holds them in memory, gate/up [E, H, 2 w] with gate and
up columns interleaved and down [E, w, H]; the original ones as MXFP4 blocks and scales, dequantized
at load (layers/mxfp4.py). Loading transposes them into StackedExperts' [E, 2 w, H] with gate's rows
first, the order its activation reads them in. A converted GGUF file (loader/gguf_architectures.py)
names them as llama.cpp splits them: gate_proj, up_proj and down_proj, [E, out, in], and their biases.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from roseinfer.distributed.parallel import TensorParallel
from roseinfer.layers.activation import ClampedSwigluAndMul
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.linear import Linear
from roseinfer.layers.mxfp4 import dequantized_mxfp4
from roseinfer.models.config import ModelConfig
from roseinfer.models.llama import DecoderForCausalLM, LlamaAttention, LlamaDecoderLayer
from roseinfer.models.moe import EXPERT_PROJECTIONS, StackedExperts
from roseinfer.models.weights import WeightLoader

# model.layers.{layer}.mlp.experts.{gate_up_proj|down_proj}[_bias], transformers' names
_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# model.layers.{layer}.mlp.experts.{gate_proj|up_proj|down_proj}.{weight|bias}, a GGUF file's
_SPLIT_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def select_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]): the top_k logits, then a
    softmax over those alone in the logits' dtype (gpt-oss's router)."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), experts


class GptOssAttention(LlamaAttention):
    """Llama's attention with this rank's heads' sinks, which its PagedAttention applies."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__(cfg, tp, layer)
        self.first_head = tp.even(cfg.num_heads * cfg.head_dim).start // cfg.head_dim
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.attn.sinks = self.sinks


class GptOssMoe(nn.Module):
    """router (with its bias, whole on every rank) -> the routed experts -> one all-reduce."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.top_k = tp, cfg.moe.top_k
        self.router = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=True)
        swiglu = cfg.clamped_swiglu
        self.experts = StackedExperts(cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_width, cfg.hidden_act, tp,
                                      bias=True, act_and_mul=ClampedSwigluAndMul(swiglu.alpha, swiglu.limit))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; meta is taken as a dense MLP takes it, and not read."""
        weights, experts = select_top_logits(self.router.forward(x), self.top_k)
        return self.tp.all_reduce(self.experts.forward(x, weights, experts))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def build_attention(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> LlamaAttention:
        return GptOssAttention(cfg, tp, layer)

    def build_mlp(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> nn.Module:
        return GptOssMoe(cfg, tp)


class GptOssForCausalLM(DecoderForCausalLM):
    layer_class = GptOssDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(dequantized_mxfp4(weights))

    def load_weight(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        if name.endswith(".self_attn.sinks"):
            attention = self.model.layers[int(name.split(".")[2])].self_attn
            loader.load(name, tensor.narrow(0, attention.first_head, attention.num_heads))
            return
        split = _SPLIT_EXPERT_TENSOR.match(name)
        if split is not None:
            self._load_split(loader, *split.groups(), tensor)
            return
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            super().load_weight(loader, name, tensor)
            return
        layer, projection, bias = match.groups()
        experts: StackedExperts = self.model.layers[int(layer)].mlp.experts
        if bias:
            if projection == "gate_up_proj":  # interleaved gate, up -> gate's, then up's
                tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
            experts.load_bias(projection, tensor)
        elif projection == "gate_up_proj":  # [E, H, 2 w], columns interleaved
            experts.load("gate_proj", None, tensor[..., 0::2].transpose(1, 2))
            experts.load("up_proj", None, tensor[..., 1::2].transpose(1, 2))
        else:  # [E, w, H]
            experts.load("down_proj", None, tensor.transpose(1, 2))
        loader.loaded.add(f"model.layers.{layer}.mlp.experts.{projection}{bias or ''}")

    def _load_split(self, loader: WeightLoader, layer: str, projection: str, kind: str, tensor: torch.Tensor) -> None:
        experts: StackedExperts = self.model.layers[int(layer)].mlp.experts
        whole = experts.load_bias(projection, tensor) if kind == "bias" else experts.load(projection, None, tensor)
        if whole:
            target = EXPERT_PROJECTIONS[projection][0]
            loader.loaded.add(f"model.layers.{layer}.mlp.experts.{target}{'_bias' if kind == 'bias' else ''}")
