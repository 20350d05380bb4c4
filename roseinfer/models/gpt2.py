"""GPT-2: learned positions, LayerNorm, fused c_attn. Checkpoints store Conv1D weights as
[in, out], so they are transposed into nn.Linear's [out, in] on load. Under tensor parallelism
(`tp`, distributed/parallel.py) c_attn and c_fc are column-parallel (c_attn's q, k and v each split
by head), the two projections back to the hidden size row-parallel, the token embedding
vocabulary-parallel; the position embedding and the norms are whole on every rank."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from roseinfer.distributed.parallel import (SINGLE, TensorParallel, column_parallel, row_parallel,
                                            vocab_parallel_embedding)
from roseinfer.layers.activation import get_activation
from roseinfer.layers.attention import AttentionMetadata, KVCache, PagedAttention
from roseinfer.layers.linear import Linear, in_row_chunks
from roseinfer.models.config import ModelConfig
from roseinfer.models.weights import WeightLoader

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.tp = tp
        heads = tp.even(hidden)  # this rank's heads' rows of each of q, k and v
        self.num_heads, self.head_dim = heads.rows // cfg.head_dim, cfg.head_dim
        self.ln_1 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_attn = column_parallel(hidden, [heads, heads, heads], bias=True)
        self.c_proj = row_parallel(hidden, hidden, tp, bias=True)
        self.ln_2 = nn.LayerNorm(hidden, eps=cfg.norm_eps)
        self.c_fc = column_parallel(hidden, [tp.even(cfg.intermediate_size)], bias=True)
        self.mlp_proj = row_parallel(cfg.intermediate_size, hidden, tp, bias=True)
        self.act = get_activation(cfg.hidden_act)
        self.attn = PagedAttention(self.num_heads, self.num_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attn = self.attn(q, k, v, kv_cache, meta)
        x = x + self.tp.all_reduce(self.c_proj(attn.reshape(tokens, -1)))
        return x + self.tp.all_reduce(in_row_chunks(self._mlp, self.ln_2(x), meta.mlp_chunk_rows))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_proj(self.act(self.c_fc(x)))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.wte = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, tp) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden_size, self.wte.num_embeddings, bias=False, device="meta")
        self.lm_head.weight = self.wte.weight  # tied: the head reads the embedding's weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.tp.embed(self.wte, input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] float logits; under tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.tp.gather_logits(self.lm_head(hidden), self.cfg.vocab_size)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, {})
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # tied head; old checkpoints store the causal mask as a buffer
            if name.endswith(CONV1D_SUFFIXES):
                tensor = tensor.t()
            name = name.replace(".attn.c_attn.", ".c_attn.").replace(".attn.c_proj.", ".c_proj.")
            name = name.replace(".mlp.c_fc.", ".c_fc.").replace(".mlp.c_proj.", ".mlp_proj.")
            loader.load(name, tensor)
        loader.check_complete()
