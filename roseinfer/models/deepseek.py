"""DeepSeek-V2 (V2-Lite: q straight from the hidden state) and DeepSeek-V3: multi-head latent
attention (layers/mla.py) and, after `first_k_dense_replace` dense layers, a mixture of experts with
shared experts (layers/deepseek_moe.py). A decoder layer reads norm -> attention -> norm -> MLP or
MoE, as Llama's.

Under tensor parallelism each rank computes its share of the heads (q, kv_b's per-head rows, o's
columns) from the whole latent, which every rank projects and caches (it is one row per token,
shared by every head), and its share of every expert's width, as models/moe.py says why.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from roseinfer.distributed.parallel import (SINGLE, TensorParallel, column_parallel, row_parallel,
                                            vocab_parallel_embedding)
from roseinfer.layers.attention import AttentionMetadata, KVCache
from roseinfer.layers.deepseek_moe import DeepseekRouter, route
from roseinfer.layers.mla import MultiHeadLatentAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.deepseek_config import mla_softmax_scale
from roseinfer.models.llama import PACKED_MODULES, DecoderForCausalLM, LlamaMLP
from roseinfer.models.moe import StackedExperts
from roseinfer.models.moe_llama import load_expert_tensor
from roseinfer.models.weights import WeightLoader


class DeepseekMoE(nn.Module):
    """Routed experts (models/moe.py's StackedExperts, each rank its share of every expert's width)
    plus the shared experts (one MLP as wide as all of them), summed."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        moe = cfg.deepseek_moe
        self.tp = tp
        self.gate = DeepseekRouter(cfg.hidden_size, moe.routing)
        self.experts = StackedExperts(moe.routing.num_experts, cfg.hidden_size, moe.expert_size, cfg.hidden_act, tp)
        self.shared_experts = LlamaMLP(replace(cfg, intermediate_size=moe.shared_size), tp) if moe.shared_size \
            else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        weights, ids = route(x, self.gate)
        out = self.tp.all_reduce(self.experts.forward(x, weights, ids))
        return out if self.shared_experts is None else out + self.shared_experts.forward(x, meta)


class DeepseekDecoderLayer(nn.Module):
    rotates = True  # every layer (DecoderForCausalLM asks)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.tp = tp
        self.self_attn = MultiHeadLatentAttention(
            cfg.hidden_size, cfg.num_heads, cfg.mla, mla_softmax_scale(cfg.raw_config, cfg.mla), cfg.norm_eps,
            cfg.attention_bias, heads_out=lambda ins, outs, bias: column_parallel(ins, [tp.even(outs)], bias),
            heads_in=lambda ins, outs, bias: row_parallel(ins, outs, tp, bias))
        self.self_attn.kv_b_proj.tp_parts = [tp.even(cfg.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim))]
        dense = layer < cfg.deepseek_moe.first_moe_layer
        self.mlp = LlamaMLP(cfg, tp) if dense else DeepseekMoE(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.tp.all_reduce(self.self_attn.forward(h, rope, kv_cache, meta))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h, meta), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.raw_config)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, tp, layer) for layer in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class DeepseekForCausalLM(DecoderForCausalLM):
    # gate and up fused, in the dense MLPs and every expert; q stays whole (it has no k or v beside it)
    packed_modules = {name: PACKED_MODULES[name] for name in ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp)
        self._kv_b_halves: dict[tuple[str, str], torch.Tensor] = {}

    def build_model(self, cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
        return DeepseekModel(cfg, tp)

    def load_weight(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= self.cfg.num_layers:
            return  # V3's multi-token-prediction layers, after the model's own
        if name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):
            self._load_kv_b_half(loader, name, tensor)
            return
        if self.cfg.mla.rope_in_halves:
            tensor = self._rope_pairs_adjacent(name, tensor)
        if not load_expert_tensor(self.model.layers, loader, name, tensor):
            loader.load(name, tensor)

    def _load_kv_b_half(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        """A GGUF file's kv_b_proj comes as its key and value halves (loader/gguf_deepseek.py): held
        until the other half arrives, then joined back, head by head, into kv_b_proj."""
        halves = self._kv_b_halves
        prefix, _, half = name.rpartition(".")[0].rpartition(".")
        halves[(prefix, half)] = tensor
        if (prefix, "k_b_proj") not in halves or (prefix, "v_b_proj") not in halves:
            return
        mla, heads = self.cfg.mla, self.cfg.num_heads
        keys = halves.pop((prefix, "k_b_proj")).reshape(heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
        values = halves.pop((prefix, "v_b_proj")).reshape(heads, mla.v_head_dim, mla.kv_lora_rank)
        loader.load(f"{prefix}.kv_b_proj.weight", torch.cat([keys, values], dim=1).reshape(-1, mla.kv_lora_rank))

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
