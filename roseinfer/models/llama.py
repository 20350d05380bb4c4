"""The Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

q/k/v and gate/up are fused into one matmul each; `load_weights` slices the checkpoint's
separate tensors into them, and reorders q/k rows for the adjacent-pair rotary (layers/rotary.py).

Inside a forward, submodules are called through `.forward`: nn.Module.__call__'s hook bookkeeping
runs ~300 times a decode step here, and skipping it made batch-1 and batch-16 steps 1-2 % faster
(interleaved A/B on this CPU). Nothing registers hooks on these modules.

A decode step whose layers all run in C (CPU fp32, packed weights the C matmul reads, no q/k norm)
goes through every decoder layer in one call (csrc/decode_layers.c), with the Python path's results.
"""
from __future__ import annotations

import ctypes
from typing import Iterable

import torch
from torch import nn

from roseinfer.layers import native
from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.embedding import VocabEmbedding
from roseinfer.layers.linear import Linear, in_row_chunks
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, apply_rotary, interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.weights import WeightLoader

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Qwen2 has bias on q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = cfg.attention_bias and cfg.model_type in ("llama", "mistral")
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on norm(x), x added into the residual stream first; returns (output, stream)."""
        tokens = x.shape[0]
        qkv, residual = self.qkv_proj.forward_normed(x, norm, residual)
        if meta.fused_decode and self.q_norm is None:
            return self.o_proj.forward(self.attn.decode_qkv(qkv, rope, kv_cache, meta)), residual
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k side by side as one [T, H + Hkv, D] view: one rotary pass instead of two
            qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rotary(qk, rope, meta.native)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm.forward(qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(
                qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, rope, meta.native), apply_rotary(k, rope, meta.native)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj.forward(out.reshape(tokens, self.q_size)), residual


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_and_mul = ActivationAndMul(cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP on norm(x), x added into the residual stream first; returns (output, stream).
        Rows the C matmul takes go through two calls, the norm and the activation each folded into
        the matmul after it; larger batches (prefill) run the MLP in row chunks."""
        if norm.native and self.gate_up_proj.takes_native_rows(x.shape[0]):
            gate_up, residual = self.gate_up_proj.forward_normed(x, norm, residual)
            return self.down_proj.forward_activated(gate_up, self.act_and_mul), residual
        h, residual = norm.add_and_norm(x, residual)
        return in_row_chunks(self._rows_forward, h), residual

    def _rows_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_activated(self.gate_up_proj.forward(x), self.act_and_mul)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at the first layer); residual: the
        stream it is added to (None at the first layer). Returns this layer's (MLP output, stream)."""
        h, residual = self.self_attn.forward(rope, x, residual, self.input_layernorm, kv_cache, meta)
        return self.mlp.forward(h, residual, self.post_attention_layernorm)

    def native_decode_layer(self, kv_cache: KVCache) -> native.DecodeLayer | None:
        """This layer as csrc/decode_layers.c reads it, or None where a part of it has no C path there."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (attn.q_norm is not None or any(layer.native_weights is None for layer in linears)
                or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None or not mlp.act_and_mul.native
                or not (self.input_layernorm.native and self.post_attention_layernorm.native)):
            return None

        def bias(layer: Linear) -> int | None:
            return None if layer.bias is None else layer.bias.data_ptr()

        return native.DecodeLayer(
            self.input_layernorm.weight.data_ptr(), self.post_attention_layernorm.weight.data_ptr(),
            attn.qkv_proj.native_weights, bias(attn.qkv_proj), attn.o_proj.native_weights, bias(attn.o_proj),
            mlp.gate_up_proj.native_weights, mlp.down_proj.native_weights, kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr())


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.raw_config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self._decode_table: tuple[list[KVCache], ctypes.Array | None] | None = None

    def native_decode_layers(self, kv_caches: list[KVCache]) -> ctypes.Array | None:
        """Every layer for csrc/decode_layers.c, or None where one of them cannot run there. Built once
        for the runner's list of caches, which it keeps for its life (the reference held here keeps
        the pointers valid)."""
        if self._decode_table is None or self._decode_table[0] is not kv_caches:
            layers = [layer.native_decode_layer(cache) for layer, cache in zip(self.layers, kv_caches)]
            table = None if None in layers else (native.DecodeLayer * len(layers))(*layers)
            self._decode_table = (kv_caches, table)
        return self._decode_table[1]


class LlamaForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:  # the head reads the embedding's weight: no weight of its own
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens.forward(input_ids)
        rope = self.model.rotary.lookup(positions)
        if meta.fused_decode and x.shape[0] <= native.PACKED_MATMUL_MAX_ROWS:
            table = self.model.native_decode_layers(kv_caches)
            if table is not None:
                return self._native_decode(table, x.contiguous(), rope, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer.forward(rope, x, residual, kv_cache, meta)
        return self.model.norm.forward(x, residual)[0]

    def _native_decode(self, table: ctypes.Array, x: torch.Tensor, rope: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        cfg, group = self.cfg, meta.groups[0]
        out = native.decode_layers(table, x, rope, meta.slot_mapping, group.block_tables, group.kv_lens,
                                   group.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.intermediate_size, cfg.norm_eps, self.model.layers[0].self_attn.attn.scale)
        return self.model.norm.forward(out, x)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()

    def shard_sizes(self, packed_name: str) -> list[int]:
        cfg = self.cfg
        if packed_name == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.packed_modules)
        rotated = (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            if any(part in name for part in rotated):
                tensor = interleave_rotary_rows(tensor, self.cfg.head_dim)  # see layers/rotary.py
            loader.load(name, tensor)
        loader.check_complete()
