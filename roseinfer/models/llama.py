"""The Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
Phi-3/Phi-4 (checkpoints with q/k/v and gate/up already fused; LongRoPE and partial rotary live in
layers/rotary.py), SmolLM3 (NoPE layers: no rotary in every fourth layer, by default).

A decoder layer reads norm -> attention -> norm -> MLP. q/k/v and gate/up are fused into one matmul
each; `load_weights` slices the checkpoint's separate tensors into them, and reorders q/k rows for
the adjacent-pair rotary (layers/rotary.py). Under tensor parallelism (`tp`, distributed/parallel.py)
a rank builds its share: its heads and MLP slice, its rows of the vocabulary; the all-reduces after
o and down, the embedding's and the logits' gather are the only places the ranks meet.

Inside a forward, submodules are called through `.forward`: nn.Module.__call__'s hook bookkeeping
runs hundreds of times a decode step, and nothing registers hooks on these modules.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from roseinfer.distributed.parallel import (SINGLE, TensorParallel, column_parallel, row_parallel,
                                            vocab_parallel_embedding)
from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention
from roseinfer.layers.linear import Linear, in_row_chunks
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rope_parameters import rotary_dim
from roseinfer.layers.rotary import RotaryEmbedding, interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.weights import WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.tp = tp
        q, kv = tp.even(cfg.num_heads * cfg.head_dim), tp.kv_heads(cfg.num_kv_heads, cfg.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = q.rows // cfg.head_dim, kv.rows // cfg.head_dim, cfg.head_dim
        self.q_size, self.kv_size = q.rows, kv.rows
        self.qkv_proj = column_parallel(cfg.hidden_size, [q, kv, kv], bias=cfg.attention_bias)
        self.o_proj = row_parallel(q.size, cfg.hidden_size, tp, bias=cfg.o_proj_bias)
        # per head (Qwen3), or over all of q and all of k at once (OLMoE: whole at tensor-parallel size 1)
        self.norm_across_heads, self.clip_qkv = cfg.qk_norm_across_heads, cfg.clip_qkv
        q_norm_width, k_norm_width = (q.rows, kv.rows) if self.norm_across_heads else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_norm_width, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_width, cfg.norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                                   sliding_window=cfg.layer_sliding_window(layer))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj.forward(self.attend(self.qkv_proj.forward(x), rope, kv_cache, meta)))

    def attend(self, qkv: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention from the q/k/v projection's output [T, q + 2 kv]; returns [T, q_size]."""
        if self.q_norm is None:
            return self.attn.forward_qkv(qkv, rope, kv_cache, meta)
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        if self.norm_across_heads:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if not self.norm_across_heads:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        out = self.attn(meta.rotate(q, rope), meta.rotate(k, rope), v, kv_cache, meta)
        return out.reshape(tokens, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        width = tp.even(cfg.intermediate_size)
        self.gate_up_proj = column_parallel(cfg.hidden_size, [width, width], bias=False)
        self.down_proj = row_parallel(cfg.intermediate_size, cfg.hidden_size, tp, bias=False)
        self.act_and_mul = ActivationAndMul(cfg.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.tp.all_reduce(in_row_chunks(self._rows, x, meta.mlp_chunk_rows))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_and_mul.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.tp = tp
        self.rotates = layer not in cfg.nope_layers  # a NoPE layer's forward gets rotations that change nothing
        self.self_attn = self.build_attention(cfg, tp, layer)
        self.mlp = self.build_mlp(cfg, tp, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def build_attention(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> LlamaAttention:
        """The layer's attention (with sinks in models/gpt_oss.py)."""
        return LlamaAttention(cfg, tp, layer)

    def build_mlp(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> nn.Module:
        """The layer's MLP, called as mlp.forward(h, meta) (a mixture of experts in models/moe_llama.py)."""
        return LlamaMLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at the first layer); residual: the
        stream it is added to (None at the first layer). Returns this layer's (MLP output, stream)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn.forward(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h, meta), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_class: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.raw_config)
        self.layers = nn.ModuleList(layer_class(cfg, tp, layer) for layer in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


# a checkpoint's separate projections -> (the fused layer, its slot)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def lm_head(cfg: ModelConfig, tp: TensorParallel, embed_tokens: nn.Module) -> Linear:
    """The LM head, this rank's rows of the vocabulary; tied, it reads the embedding's weight."""
    vocab = tp.vocab(cfg.vocab_size)
    if not cfg.tie_word_embeddings:
        return column_parallel(cfg.hidden_size, [vocab], bias=False)
    head = Linear(cfg.hidden_size, vocab.rows, bias=False, device="meta")
    head.weight = embed_tokens.weight
    return head


class DecoderForCausalLM(nn.Module):
    """embed -> the decoder layers (`layer_class`) -> norm -> LM head, shared by the dense Llama family
    (LlamaForCausalLM), the mixtures of experts built on its layers (models/moe_llama.py), DeepSeek
    (models/deepseek.py) and the hybrid linear-attention families (models/qwen3_5.py), whose stacks
    `build_model` returns. A layer class takes (cfg, tp, layer index), has `rotates` and Llama's forward."""

    packed_modules = PACKED_MODULES
    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = self.build_model(cfg, tp)
        self.lm_head = lm_head(cfg, tp, self.model.embed_tokens)

    def build_model(self, cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
        """The stack: embed_tokens, rotary, layers (each with `rotates` and Llama's forward), norm."""
        return LlamaModel(cfg, tp, self.layer_class)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.tp.embed(self.model.embed_tokens, input_ids)
        rope = self.model.rotary.lookup(positions)
        # NoPE layers rotate by 1 + 0i, which leaves q and k bit for bit: every backend's path serves them
        unrotated = torch.ones_like(rope) if self.cfg.nope_layers else rope
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope if layer.rotates else unrotated, kv_cache, meta)
        return self.model.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] float logits; under tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.tp.gather_logits(self.lm_head.forward(hidden), self.cfg.vocab_size)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.packed_modules)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            self.load_weight(loader, name, tensor)
        loader.check_complete()

    def load_weight(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor, q and k rows reordered for the adjacent-pair rotary (layers/rotary.py)."""
        dims = rotary_dim(self.cfg.head_dim, self.cfg.raw_config)
        if any(part in name for part in (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")):
            tensor = interleave_rotary_rows(tensor, self.cfg.head_dim, dims)
        elif ".qkv_proj." in name:  # Phi-3 ships q/k/v fused: reorder its q and k rows the same way
            q, k, v = tensor.split([self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim,
                                    self.cfg.num_kv_heads * self.cfg.head_dim])
            tensor = torch.cat([interleave_rotary_rows(q, self.cfg.head_dim, dims),
                                interleave_rotary_rows(k, self.cfg.head_dim, dims), v])
        loader.load(name, tensor)  # a fused qkv_proj / gate_up_proj fills its layer whole


class LlamaForCausalLM(DecoderForCausalLM):
    """The dense Llama family: the class whose decode steps the CPU backend runs in one C call."""
