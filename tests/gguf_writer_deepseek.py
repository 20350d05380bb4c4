"""Write a tiny transformers DeepSeek-V2 / V3 to GGUF as llama.cpp's convert_hf_to_gguf.py writes its
`deepseek2` architecture (conversion/deepseek.py): the latent attention as MQA with the per-head
widths in key_length_mla / value_length_mla, kv_b_proj split per head into attn_k_b (each head's key
rows transposed) and attn_v_b, the experts stacked into 3-D `ffn_*_exps`, V3's correction bias as
exp_probs_b, its sigmoid gating and YaRN's mscale as yarn_log_multiplier."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from gguf_writer import _add_tokenizer, _expert_tensors, encode_weights

_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _tensors(hf_model: torch.nn.Module) -> dict[str, np.ndarray]:
    """GGUF name -> data, in the converter's layout."""
    cfg = hf_model.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in _expert_tensors(hf_model.state_dict()).items():
        data = tensor.detach().float().numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = data
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        stem, _, suffix = rest.rpartition(".")
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = data
        elif stem == "self_attn.kv_b_proj":
            per_head = data.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            keys, values = np.split(per_head, [cfg.qk_nope_head_dim], axis=1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(keys.transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(values)
        elif stem == "mlp.experts":  # stacked [E, out, in]
            out[f"blk.{layer}.ffn_{suffix.removesuffix('_proj')}_exps.weight"] = data
        else:
            out[f"blk.{layer}.{_BLOCK[stem]}.{suffix}"] = data
    return out


def _add_metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # "deepseek2 using MLA converts into MQA"
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if getattr(cfg, "norm_topk_prob", False):
        w.add_expert_weights_norm(True)
    if (cfg.n_group or 1) > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    v3 = cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_deepseek_gguf(path: Path, hf_model: torch.nn.Module, tokenizer: Any, qtype: str = "F32") -> Path:
    """hf_model (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM) as a `deepseek2` GGUF file; qtype for
    the matrices whose rows fit its blocks (the others F32, as write_tiny_gguf does)."""
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("tiny-deepseek")
    _add_metadata(w, hf_model.config)
    _add_tokenizer(w, tokenizer)
    rng = np.random.default_rng(0)
    for name, data in _tensors(hf_model).items():
        stored, stored_type = encode_weights(np.ascontiguousarray(data), QT[qtype], rng)
        w.add_tensor(name, stored, raw_dtype=None if stored_type in (QT.F32, QT.F16) else stored_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
