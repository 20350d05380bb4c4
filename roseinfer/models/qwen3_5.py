"""Qwen3.5 (dense text), Qwen3-Next and Qwen3.5-MoE: three of every four layers are Gated DeltaNet
(linear attention whose per-request state lives in the state pool, engine/state_pool.py), the fourth
gated full attention over the paged KV cache; the MoE variants' MLP is a mixture of experts with a
gated shared expert (models/moe.py). Multimodal checkpoints' text model (`model.language_model.*`)
loads too; their vision tower and the multi-token-prediction head are not read.

A decoder layer reads norm -> token mixer -> norm -> MLP, the norms scaling by (1 + w). The full
layer's q projection gives each head its query and an output gate side by side; its q/k norms and
partial rotary (the first quarter of each head) follow. `kv_caches[i]` is layer i's (K, V) pool
for a full layer and its (conv state, recurrent state) pool for a linear one (worker/model_runner.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.distributed.parallel import TensorParallel, column_parallel
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention
from roseinfer.layers.gated_delta_rule import conv_decode, conv_prefill, l2_normalise
from roseinfer.layers.linear import Linear
from roseinfer.layers.rope_parameters import rotary_dim
from roseinfer.layers.rotary import interleave_rotary_rows
from roseinfer.models.config import ModelConfig
from roseinfer.models.gemma_layers import GemmaRMSNorm, text_model_name
from roseinfer.models.hybrid_config import LinearAttentionShape
from roseinfer.models.llama import PACKED_MODULES, DecoderForCausalLM, LlamaMLP, LlamaModel
from roseinfer.models.moe import SparseMoeBlock
from roseinfer.models.moe_llama import load_expert_tensor
from roseinfer.models.weights import WeightLoader

# the linear layer's four input projections are one matmul
HYBRID_PACKED_MODULES = {**PACKED_MODULES, "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1),
                         "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3)}
_NOT_TEXT = ("mtp.", "model.visual.")  # the multi-token-prediction head, a multimodal checkpoint's vision tower


def _unit_offset_norm(dim: int, eps: float) -> GemmaRMSNorm:
    return GemmaRMSNorm(dim, eps, weight_offset=1.0)


class Conv1dWeight(nn.Module):
    """The depthwise causal convolution's weight [channels, 1, kernel], as checkpoints name it."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    """Per head: RMS-normalised in float32, scaled by w (not 1 + w) in the model's dtype, then gated
    by silu(z) in float32, as transformers' Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(dtype)).float() * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: projections, causal conv with state, L2-normed q/k, the gated
    delta rule (layers/gated_delta_rule.py) and a gated RMSNorm before the output projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        shape = cfg.linear_attention
        self.k_heads, self.v_heads = shape.num_k_heads, shape.num_v_heads
        self.k_dim, self.v_dim = shape.k_head_dim, shape.v_head_dim
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = shape.conv_dim
        self.in_proj = column_parallel(cfg.hidden_size, [tp.even(self.conv_dim), tp.even(self.value_size),
                                                         tp.even(self.v_heads), tp.even(self.v_heads)], bias=False)
        self.conv1d = Conv1dWeight(self.conv_dim, shape.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        mixed, z, b, a = self.in_proj.forward(x).split([self.conv_dim, self.value_size, self.v_heads,
                                                        self.v_heads], dim=-1)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self.recur(mixed, g, beta, state, meta)
        gated = self.norm.forward(out, z.view(tokens, self.v_heads, self.v_dim), x.dtype)
        return self.out_proj.forward(gated.view(tokens, self.value_size))

    def recur(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: KVCache,
              meta: AttentionMetadata) -> torch.Tensor:
        """The causal conv and the gated delta rule over the step's rows, from the conv's input
        mixed [T, conv_dim], decay g and beta [T, v_heads]; each sequence continues its slot's state
        (meta.linear_state) and leaves its next state there, a verified draft's passing through its
        scratch slots position by position. Returns o [T, v_heads, v_dim] in float32."""
        batch = meta.linear_state
        weight = self.conv1d.weight[:, 0]
        out = torch.empty(mixed.shape[0], self.v_heads, self.v_dim, dtype=torch.float32, device=mixed.device)
        conv_pool, recurrent_pool = state
        if batch.decode_seqs.numel():
            seqs, rows = batch.decode_seqs, batch.decode_rows
            slots, keep = batch.slots[seqs], batch.keep[seqs]
            conv, conv_pool[slots] = conv_decode(mixed[rows], conv_pool[slots] * keep[:, None, None].to(mixed.dtype),
                                                 weight)
            q, k, v = self._heads(conv)
            out[rows] = meta.delta_rule_decode(q, k, v, g[rows], beta[rows], recurrent_pool, slots, keep)
        for position in batch.draft_positions:
            # the decode step itself, its state read from one slot and left in another (the source kept)
            rows, sources, targets = position.rows, position.sources, position.targets
            conv, conv_pool[targets] = conv_decode(mixed[rows], conv_pool[sources], weight)
            q, k, v = self._heads(conv)
            recurrent_pool[targets] = recurrent_pool[sources]
            out[rows] = meta.delta_rule_decode(q, k, v, g[rows], beta[rows], recurrent_pool, targets, position.keep)
        if batch.prefill_seqs.numel():
            seqs, rows, valid = batch.prefill_seqs, batch.prefill_rows, batch.prefill_valid
            slots, keep = batch.slots[seqs], batch.keep[seqs]
            conv, conv_pool[slots] = conv_prefill(mixed[rows] * valid.unsqueeze(-1).to(mixed.dtype),
                                                  conv_pool[slots] * keep[:, None, None].to(mixed.dtype), weight,
                                                  batch.prefill_lens)
            mask = valid.unsqueeze(-1).unsqueeze(-1)  # padding: zero q/k/v, g and beta leave the state as it was
            q, k, v = (t * mask for t in self._heads(conv))
            o = meta.delta_rule_prefill(q, k, v, g[rows] * valid.unsqueeze(-1), beta[rows] * valid.unsqueeze(-1),
                                        recurrent_pool, slots, keep, batch.prefill_lens)
            out[rows[valid > 0]] = o[valid > 0]
        return out

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (L2-normed, q scaled, k heads repeated up to the v heads) and v in float32, from the conv's
        output [..., conv_dim]."""
        lead = conv.shape[:-1]
        q, k, v = conv.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = (l2_normalise(t.view(*lead, self.k_heads, self.k_dim)) for t in (q, k))
        if self.v_heads != self.k_heads:
            q, k = (t.repeat_interleave(self.v_heads // self.k_heads, dim=-2) for t in (q, k))
        return q * self.k_dim ** -0.5, k, v.view(*lead, self.v_heads, self.v_dim)


class GatedAttention(nn.Module):
    """Full attention whose output each head gates by sigmoid of a second half of its q projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = tp.even(2 * cfg.num_heads * cfg.head_dim), tp.kv_heads(cfg.num_kv_heads, cfg.head_dim)
        self.q_size, self.kv_size = q.rows, kv.rows
        self.qkv_proj = column_parallel(cfg.hidden_size, [q, kv, kv], bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = _unit_offset_norm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = _unit_offset_norm(cfg.head_dim, cfg.norm_eps)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = self.q_norm.forward(q.contiguous())
        k = self.k_norm.forward(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(meta.rotate(q, rope), meta.rotate(k, rope), v, kv_cache, meta)
        return self.o_proj.forward((out * torch.sigmoid(gate)).reshape(tokens, self.num_heads * self.head_dim))


class Qwen3_5DecoderLayer(nn.Module):
    rotates = True  # DecoderForCausalLM's NoPE switch: every full-attention layer here rotates

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, tp)
        else:
            self.self_attn = GatedAttention(cfg, tp)
        if cfg.moe is not None and layer in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp)
        else:
            self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = _unit_offset_norm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = _unit_offset_norm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = (self.linear_attn.forward(h, cache, meta) if self.is_linear
             else self.self_attn.forward(h, rope, cache, meta))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h, meta), residual


class Qwen3_5Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_class: type[nn.Module]) -> None:
        super().__init__(cfg, tp, layer_class)
        self.norm = _unit_offset_norm(cfg.hidden_size, cfg.norm_eps)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 dense, Qwen3-Next and Qwen3.5-MoE (the latter two a mixture of experts with a gated
    shared expert, models/moe.py). One rank only: engine/llm_engine.py check_hybrid refuses more."""

    packed_modules = HYBRID_PACKED_MODULES
    layer_class = Qwen3_5DecoderLayer

    def build_model(self, cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
        return Qwen3_5Model(cfg, tp, self.layer_class)

    def load_weight(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(_NOT_TEXT) or name.startswith("model.language_model.visual."):
            return
        name = text_model_name(name)
        if name is None or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return
        if name.endswith((".in_proj_qkvz.weight", ".in_proj_ba.weight")):
            for part, rows in split_qwen3_next_projection(name, tensor, self.cfg.linear_attention):
                loader.load(part, rows)
            return
        if load_expert_tensor(self.model.layers, loader, name, tensor):
            return
        head_dim = self.cfg.head_dim
        dims = rotary_dim(head_dim, self.cfg.raw_config)
        # rotary pairs adjacent dims (layers/rotary.py): q's rows within each [query, gate] head, k's rows
        if ".self_attn.q_proj." in name:
            tensor = interleave_rotary_rows(tensor, 2 * head_dim, dims)
        elif any(part in name for part in (".self_attn.k_proj.", ".self_attn.q_norm.", ".self_attn.k_norm.")):
            tensor = interleave_rotary_rows(tensor, head_dim, dims)
        loader.load(name, tensor)


def split_qwen3_next_projection(name: str, tensor: torch.Tensor,
                                shape: LinearAttentionShape) -> list[tuple[str, torch.Tensor]]:
    """Qwen3-Next fuses the linear layer's input projections grouped by key head: in_proj_qkvz holds,
    per key head, its q, k and its value heads' v and z rows; in_proj_ba its value heads' b then a.
    Returns Qwen3.5's separate in_proj_qkv / z / b / a (q, k, v each over all heads in order)."""
    per_k = shape.num_v_heads // shape.num_k_heads
    prefix = name.rsplit(".", 2)[0]
    if name.endswith(".in_proj_ba.weight"):
        b, a = tensor.view(shape.num_k_heads, 2 * per_k, -1).split(per_k, dim=1)
        return [(f"{prefix}.in_proj_b.weight", b.reshape(shape.num_v_heads, -1)),
                (f"{prefix}.in_proj_a.weight", a.reshape(shape.num_v_heads, -1))]
    v_rows = per_k * shape.v_head_dim
    grouped = tensor.view(shape.num_k_heads, 2 * shape.k_head_dim + 2 * v_rows, -1)
    q, k, v, z = (t.reshape(-1, tensor.shape[-1]) for t in grouped.split(
        [shape.k_head_dim, shape.k_head_dim, v_rows, v_rows], dim=1))
    return [(f"{prefix}.in_proj_qkv.weight", torch.cat([q, k, v])), (f"{prefix}.in_proj_z.weight", z)]
