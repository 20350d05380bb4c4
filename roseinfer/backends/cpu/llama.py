"""The Llama family on the CPU backend, swapped in at load (`install`): the norm before q/k/v and
gate/up, and SiLU * up before down, computed inside the matmul calls after them (NativeRowsLinear:
packed fp32 or GGUF blocks), and a decode step's decoder layers all run in one C call
(csrc/decode_layers.c), except under tensor parallelism, whose all-reduces sit between the layers'
matmuls.

Python between matmuls runs cache-cold (the weights of each matmul evict it), so every crossing
into C that a decode step saves counts; the one-call stack calls the same C functions in the same
order on the same buffers, so its results are the layer-by-layer path's bit for bit."""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.attention import CPUMetadata
from roseinfer.backends.cpu.layers import NativeRowsLinear, NativeSiluAndMul
from roseinfer.layers.attention import KVCache
from roseinfer.layers.linear import in_row_chunks
from roseinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class CPULlamaDecoderLayer(LlamaDecoderLayer):
    """norm -> attention -> norm -> MLP, each norm inside the matmul call after it where its rows go
    to the C matmul (`NativeRowsLinear.forward_normed`): the same numbers, fewer calls."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor, kv_cache: KVCache,
                meta: CPUMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_normed(x, self.input_layernorm, residual)
        h = self.tp.all_reduce(attn.o_proj.forward(attn.attend(qkv, rope, kv_cache, meta)))
        if mlp.gate_up_proj.takes_native_rows(h.shape[0]):
            gate_up, residual = mlp.gate_up_proj.forward_normed(h, self.post_attention_layernorm, residual)
            return self.tp.all_reduce(mlp.down_proj.forward_activated(gate_up, mlp.act_and_mul)), residual
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.tp.all_reduce(in_row_chunks(self._mlp_rows, h, meta.mlp_chunk_rows)), residual

    def _mlp_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj.forward_activated(self.mlp.gate_up_proj.forward(x), self.mlp.act_and_mul)

    def decode_layer(self, kv_cache: KVCache) -> ctypes.Structure | None:
        """This layer as csrc/decode_layers.c reads it, or None where a part of it has no C path there."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (attn.q_norm is not None or any(layer.native_weights is None for layer in linears)
                or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None
                or not isinstance(mlp.act_and_mul, NativeSiluAndMul)):
            return None

        def bias(layer: NativeRowsLinear) -> int | None:
            return None if layer.bias is None else layer.bias.data_ptr()

        return ops.decode_layer_struct()(
            input_norm=self.input_layernorm.weight.data_ptr(), post_norm=self.post_attention_layernorm.weight.data_ptr(),
            qkv=attn.qkv_proj.native_weights, qkv_bias=bias(attn.qkv_proj), o=attn.o_proj.native_weights,
            o_bias=bias(attn.o_proj), gate_up=mlp.gate_up_proj.native_weights, down=mlp.down_proj.native_weights,
            k_cache=kv_cache[0].data_ptr(), v_cache=kv_cache[1].data_ptr(), qkv_type=attn.qkv_proj.native_type,
            o_type=attn.o_proj.native_type, gate_up_type=mlp.gate_up_proj.native_type,
            down_type=mlp.down_proj.native_type, sliding_window=attn.attn.sliding_window or 0,
            logit_softcap=attn.attn.logit_softcap or 0.0, no_rope=int(not self.rotates))


class CPULlamaForCausalLM(LlamaForCausalLM):
    """A decode step of up to PACKED_MATMUL_MAX_ROWS rows whose layers all have C paths runs them in
    one call; anything else goes layer by layer."""

    _decode_table: tuple[list[KVCache], ctypes.Array | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: CPUMetadata) -> torch.Tensor:
        if meta.fused_decode and input_ids.shape[0] <= ops.PACKED_MATMUL_MAX_ROWS:
            table = self.decode_layers(kv_caches)
            if table is not None:
                x = self.model.embed_tokens.forward(input_ids).contiguous()
                group = meta.groups[0]
                cfg, attn = self.cfg, self.model.layers[0].self_attn.attn
                out = ops.decode_layers(table, x, self.model.rotary.lookup(positions), meta.slot_mapping,
                                        group.block_tables, group.kv_lens, group.block_size, cfg.num_heads,
                                        cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.norm_eps,
                                        attn.scale)
                return self.model.norm.forward(out, x)[0]
        return super().forward(input_ids, positions, kv_caches, meta)

    def decode_layers(self, kv_caches: list[KVCache]) -> ctypes.Array | None:
        """Every layer for csrc/decode_layers.c, or None where one of them cannot run there. Built once
        for the runner's list of caches, which it keeps for its life (the reference held here keeps
        the pointers valid)."""
        if self._decode_table is None or self._decode_table[0] is not kv_caches:
            layers = [layer.decode_layer(cache) for layer, cache in zip(self.model.layers, kv_caches)]
            table = None if None in layers else (ops.decode_layer_struct() * len(layers))(*layers)
            self._decode_table = (kv_caches, table)
        return self._decode_table[1]


def install(model: nn.Module, whole_stack: bool = True) -> None:
    """The CPU Llama classes, where the linears are packed (else the generic ones stay); without
    whole_stack (tensor parallelism), the layers but not the one-call decoder stack."""
    if not isinstance(model, LlamaForCausalLM):
        return
    layers = model.model.layers
    if all(isinstance(layer.self_attn.qkv_proj, NativeRowsLinear) for layer in layers):
        for layer in layers:
            layer.__class__ = CPULlamaDecoderLayer
        if whole_stack:
            model.__class__ = CPULlamaForCausalLM
