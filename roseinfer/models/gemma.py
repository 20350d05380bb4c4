"""The Gemma family: Gemma 2, Gemma 3 (text; also the text model of Gemma3ForConditionalGeneration)
and Gemma 4 dense text.

A decoder layer reads norm -> attention -> norm, norm -> MLP -> norm: every sub-block's output is
normed again before it joins the residual stream. Layers are sliding-window (local) or global
(`ModelConfig.layer_types`), each type with its own rope table. Gemma 2 soft-caps attention
scores; Gemma 3 and 4 norm q and k per head instead. Gemma 4 adds per-layer-type head shapes,
values normed without a weight (and, where `k_eq_v`, taken from the key projection), layers that
attend to an earlier layer's K/V, per-layer embeddings and a per-layer output scale.

q/k/v and gate/up are fused as in models/llama.py, which shares its MLP and tensor-parallel split
with this file; the norms are models/gemma_layers.py's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch
from torch import nn

from roseinfer.distributed.parallel import (SINGLE, TensorParallel, column_parallel, row_parallel,
                                            vocab_parallel_embedding)
from roseinfer.layers.activation import get_activation
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention
from roseinfer.layers.linear import Linear
from roseinfer.layers.rotary import RotaryEmbedding, interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.gemma_layers import GemmaRMSNorm, kv_cache_view, rms_normalise, text_model_name
from roseinfer.models.llama import PACKED_MODULES, LlamaMLP, lm_head
from roseinfer.models.weights import WeightLoader

FULL = "full_attention"
# this step's K/V and cache of the last layer of each type that computed its own (Gemma 4 sharing)
SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor, KVCache]]


def layer_head_shape(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(kv heads, head dim) of one layer in the checkpoint (Gemma 4's differ by layer type)."""
    if cfg.gemma4 is None:
        return cfg.num_kv_heads, cfg.head_dim
    return cfg.gemma4.head_shapes[layer]


def shares_kv(cfg: ModelConfig, layer: int) -> bool:
    return cfg.gemma4 is not None and layer >= cfg.num_layers - cfg.gemma4.kv_shared_layers


def hidden_norm(cfg: ModelConfig) -> GemmaRMSNorm:
    """A norm over the hidden size: (1 + w) in Gemma 2 and 3, w in Gemma 4."""
    return GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, 0.0 if cfg.gemma4 is not None else 1.0)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.layer_type = cfg.layer_types[layer]
        kv_heads, head_dim = layer_head_shape(cfg, layer)
        self.shares_kv = shares_kv(cfg, layer)
        self.k_eq_v = cfg.gemma4 is not None and cfg.gemma4.k_eq_v and self.layer_type == FULL
        q, kv = tp.even(cfg.num_heads * head_dim), tp.kv_heads(kv_heads, head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = q.rows // head_dim, kv.rows // head_dim, head_dim
        self.q_size, self.kv_size = q.rows, kv.rows
        parts = [q] if self.shares_kv else [q, kv] if self.k_eq_v else [q, kv, kv]
        self.qkv_proj = column_parallel(cfg.hidden_size, parts, bias=cfg.attention_bias)
        self.o_proj = row_parallel(q.size, cfg.hidden_size, tp, bias=cfg.attention_bias)
        weight_offset = 0.0 if cfg.gemma4 is not None else 1.0
        self.q_norm = GemmaRMSNorm(head_dim, cfg.norm_eps, weight_offset) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, cfg.norm_eps, weight_offset) if cfg.qk_norm and not self.shares_kv \
            else None
        self.norm_eps = cfg.norm_eps
        self.norms_values = cfg.gemma4 is not None  # Gemma 4: RMS-normed values, no weight
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim,
                                   cfg.attn_scale if cfg.attn_scale is not None else head_dim ** -0.5,
                                   sliding_window=cfg.layer_sliding_window(layer),
                                   logit_softcap=cfg.attn_logit_softcap)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                shared: SharedKV | None) -> torch.Tensor:
        """shared: Gemma 4's K/V by layer type, filled by the layers that compute their own."""
        qkv = self.qkv_proj.forward(x)
        tokens = qkv.shape[0]
        kv_cache = kv_cache_view(kv_cache, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # Gemma 2: rotary on the fused output, as for Llama
            out = self.attn.forward_qkv(qkv, rope, kv_cache, meta)
            return self.tp.all_reduce(self.o_proj.forward(out))
        q = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
        q = meta.rotate(self.q_norm.forward(q), rope)
        if self.shares_kv:
            k, v, kv_cache = shared[self.layer_type]  # written again to the same slots: the same values
        else:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads,
                                                                                self.head_dim)
            k = meta.rotate(self.k_norm.forward(k), rope)
            if self.norms_values:
                v = rms_normalise(v.float(), self.norm_eps).to(v.dtype)
                shared[self.layer_type] = (k, v, kv_cache)
        out = self.attn(q, k, v, kv_cache, meta).reshape(tokens, self.q_size)
        return self.tp.all_reduce(self.o_proj.forward(out))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer, tp)
        g4 = cfg.gemma4
        wide = g4 is not None and g4.double_wide_mlp and shares_kv(cfg, layer)
        self.mlp = LlamaMLP(replace(cfg, intermediate_size=cfg.intermediate_size * (2 if wide else 1)), tp)
        self.input_layernorm, self.post_attention_layernorm = hidden_norm(cfg), hidden_norm(cfg)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = hidden_norm(cfg), hidden_norm(cfg)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if g4 is not None else None
        per_layer_size = g4.per_layer_input_size if g4 is not None else 0
        if per_layer_size:
            self.act = get_activation(cfg.hidden_act)
            self.per_layer_input_gate = Linear(cfg.hidden_size, per_layer_size, bias=False)
            self.per_layer_projection = Linear(per_layer_size, cfg.hidden_size, bias=False)
            self.post_per_layer_input_norm = hidden_norm(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, shared: SharedKV | None, per_layer_input: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the previous layer's output; residual: the stream it joins (None: x is the stream).
        Returns (this layer's output, the stream it joins)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.post_attention_layernorm.forward(self.self_attn.forward(h, rope, kv_cache, meta, shared))
        h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
        h = self.post_feedforward_layernorm.forward(self.mlp.forward(h, meta))
        if self.layer_scalar is None:
            return h, residual
        # Gemma 4 scales the whole stream at the end of the layer: the residual add cannot wait
        stream = residual + h
        if per_layer_input is not None:
            gate = self.act(self.per_layer_input_gate.forward(stream)) * per_layer_input
            stream = stream + self.post_per_layer_input_norm.forward(self.per_layer_projection.forward(gate))
        return stream * self.layer_scalar, None


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        head_dims = {cfg.layer_types[i]: layer_head_shape(cfg, i)[1] for i in range(cfg.num_layers)}
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(dim, cfg.max_position_embeddings, cfg.raw_config, kind)
                                     for kind, dim in head_dims.items()})
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = hidden_norm(cfg)
        g4 = cfg.gemma4
        if g4 is not None and g4.per_layer_input_size:
            width = cfg.num_layers * g4.per_layer_input_size
            self.embed_tokens_per_layer = vocab_parallel_embedding(g4.per_layer_vocab_size, width, tp)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(g4.per_layer_input_size, cfg.norm_eps, 0.0)


class GemmaForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = GemmaModel(cfg, tp)
        self.lm_head = lm_head(cfg, tp, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.tp.embed(self.model.embed_tokens, input_ids)
        # HF scales in the model's dtype: sqrt(hidden) rounded to it, as the checkpoints were trained
        x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        per_layer_inputs = self._per_layer_inputs(input_ids, x)
        ropes = {kind: rotary.lookup(positions) for kind, rotary in self.model.rotary.items()}
        shared: SharedKV | None = {} if self.cfg.gemma4 is not None else None
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, i]
            x, residual = layer.forward(x, residual, ropes[self.cfg.layer_types[i]], kv_cache, meta, shared,
                                        per_layer_input)
        return self.model.norm.add_and_norm(x, residual)[0]

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer embeddings, [T, layers, size]: a token's own row of a second table,
        averaged with a projection of its embedding."""
        g4 = self.cfg.gemma4
        if g4 is None or not g4.per_layer_input_size:
            return None
        shape = (input_ids.shape[0], self.cfg.num_layers, g4.per_layer_input_size)
        rows = self.tp.embed(self.model.embed_tokens_per_layer, input_ids)
        rows = (rows * torch.tensor(g4.per_layer_input_size ** 0.5, dtype=rows.dtype)).reshape(shape)
        projected = self.model.per_layer_model_projection.forward(embeds) * self.cfg.hidden_size ** -0.5
        projected = self.model.per_layer_projection_norm.forward(projected.reshape(shape))
        return (projected + rows) * 2.0 ** -0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] float logits, soft-capped where the config says; on rank 0 only under tensor
        parallelism (None elsewhere)."""
        logits = self.tp.gather_logits(self.lm_head.forward(hidden), self.cfg.vocab_size)
        cap = self.cfg.final_logit_softcap
        if logits is None or cap is None:
            return None if logits is None else logits.float()
        return (logits / cap).tanh_().mul_(cap).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.packed_modules)
        for name, tensor in weights:
            name = text_model_name(name)
            if name is None or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            if ".layers." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                tensor = self._rotary_layout(name, tensor, layer)
            loader.load(name, tensor)
        loader.check_complete()

    def _rotary_layout(self, name: str, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """q/k rows (and their norms) to adjacent rotary pairs (layers/rotary.py); where values are
        the keys' projection (k_eq_v) they come out of attention in that order too, so o_proj's
        input columns follow."""
        head_dim = layer_head_shape(self.cfg, layer)[1]
        if any(part in name for part in (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")):
            return interleave_rotary_rows(tensor, head_dim)
        if ".o_proj.weight" in name and self.model.layers[layer].self_attn.k_eq_v:
            return interleave_rotary_rows(tensor.t(), head_dim).t().contiguous()
        return tensor
