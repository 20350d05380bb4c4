"""DeepSeek-V2 (V2-Lite: q straight from the hidden state) and DeepSeek-V3: multi-head latent
attention (layers/mla.py) and, after `first_k_dense_replace` dense layers, a mixture of experts with
shared experts (layers/deepseek_moe.py). A decoder layer reads norm -> attention -> norm -> MLP or
MoE, as Llama's. Tensor parallelism is refused (worker/sharding.py): the latent is not split yet.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch
from torch import nn

from roseinfer.distributed.parallel import (SINGLE, TensorParallel, column_parallel, row_parallel,
                                            vocab_parallel_embedding)
from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.attention import AttentionMetadata, KVCache
from roseinfer.layers.deepseek_moe import DeepseekRouter, RoutedExperts, route
from roseinfer.layers.mla import MultiHeadLatentAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.deepseek_config import mla_softmax_scale
from roseinfer.models.llama import PACKED_MODULES, LlamaMLP, lm_head
from roseinfer.models.weights import WeightLoader


class Expert(nn.Module):
    """One SwiGLU expert; gate and up fused as in LlamaMLP."""

    def __init__(self, hidden_size: int, width: int, act: str) -> None:
        super().__init__()
        part = SINGLE.even(width)
        self.gate_up_proj = column_parallel(hidden_size, [part, part], bias=False)
        self.down_proj = row_parallel(width, hidden_size, SINGLE, bias=False)
        self.act_and_mul = ActivationAndMul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_and_mul.forward(self.gate_up_proj.forward(x)))


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts (one MLP as wide as all of them), summed."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        moe = cfg.deepseek_moe
        self.gate = DeepseekRouter(cfg.hidden_size, moe.routing)
        self.experts = RoutedExperts(Expert(cfg.hidden_size, moe.expert_size, cfg.hidden_act)
                                     for _ in range(moe.routing.num_experts))
        self.shared_experts = LlamaMLP(replace(cfg, intermediate_size=moe.shared_size), tp) if moe.shared_size \
            else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        weights, ids = route(x, self.gate)
        out = self.experts.forward(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts.forward(x, meta)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(cfg.hidden_size, cfg.num_heads, cfg.mla,
                                                  mla_softmax_scale(cfg.raw_config, cfg.mla), cfg.norm_eps,
                                                  cfg.attention_bias)
        dense = layer < cfg.deepseek_moe.first_moe_layer
        self.mlp = LlamaMLP(cfg, tp) if dense else DeepseekMoE(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn.forward(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h, meta), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.raw_config)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, tp, layer) for layer in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class DeepseekForCausalLM(nn.Module):
    # gate and up fused, in the dense MLPs and every expert; q stays whole (it has no k or v beside it)
    packed_modules = {name: PACKED_MODULES[name] for name in ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = DeepseekModel(cfg, tp)
        self.lm_head = lm_head(cfg, tp, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.tp.embed(self.model.embed_tokens, input_ids)
        rope = self.model.rotary.lookup(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta)
        return self.model.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_logits(self.lm_head.forward(hidden), self.cfg.vocab_size)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.packed_modules)
        for name, tensor in weights:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= self.cfg.num_layers:
                continue  # V3's multi-token-prediction layers, after the model's own
            if self.cfg.mla.rope_in_halves:
                tensor = self._rope_pairs_adjacent(name, tensor)
            loader.load(name, tensor)
        loader.check_complete()

    def _rope_pairs_adjacent(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint that rotates halves (rope_interleave false): its rope rows to adjacent pairs
        (layers/rotary.py), each head's in q, the shared key's in kv_a_proj_with_mqa."""
        mla = self.cfg.mla
        if ".q_proj." in name or ".q_b_proj." in name:
            head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            per_head = tensor.reshape(self.cfg.num_heads, head, -1)
            rope = interleave_rotary_rows(per_head[:, mla.qk_nope_head_dim:].reshape(-1, per_head.shape[2]),
                                          mla.qk_rope_head_dim)
            rope = rope.reshape(self.cfg.num_heads, mla.qk_rope_head_dim, -1)
            return torch.cat([per_head[:, :mla.qk_nope_head_dim], rope], dim=1).reshape(tensor.shape)
        if ".kv_a_proj_with_mqa." in name:
            latent, rope = tensor.split([mla.kv_lora_rank, mla.qk_rope_head_dim])
            return torch.cat([latent, interleave_rotary_rows(rope, mla.qk_rope_head_dim)])
        return tensor
