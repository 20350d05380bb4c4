"""llama.cpp's `deepseek2` architecture (DeepSeek-V2 / V2-Lite / V3 in GGUF) in Hugging Face terms.

convert_hf_to_gguf writes the latent attention as MQA (head_count_kv 1, key_length kv_lora_rank +
rope dims; the per-head widths as key_length_mla / value_length_mla), stacks the experts into 3-D
`ffn_*_exps`, and splits kv_b_proj per head into attn_k_b [H, kv_lora_rank, qk_nope] (each head's
key rows transposed, for its absorbed attention) and attn_v_b [H, v_head_dim, kv_lora_rank]. Here
they become `self_attn.k_b_proj` [H * qk_nope, kv_lora_rank] and `self_attn.v_b_proj`, which
models/deepseek.py joins back into kv_b_proj (so the fp32 folder of a deepseek2 file is roseinfer's,
not a transformers checkpoint). V3 is told from V2 by its sigmoid gating. Rotary pairs are adjacent
in the file, as DeepSeek's own checkpoints have them (rope_interleave)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

DEEPSEEK_ARCHITECTURES: tuple[str, ...] = ("deepseek2",)
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_YARN_LOG_MULTIPLIER = 0.1  # convert_hf_to_gguf writes 0.1 * mscale_all_dim as yarn_log_multiplier

DEEPSEEK_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip


def deepseek_config(get: Callable[..., Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                    rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's DeepSeek fields, from the generic ones build_config made (config) and the file's."""
    v3 = get("expert_gating_func") == _SIGMOID_GATING or any(".exp_probs_b." in name for name in shapes)
    heads, rope_dims = config["num_attention_heads"], int(get("rope.dimension_count", required=True))
    groups = int(get("expert_group_count", 1))
    fields: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", "num_key_value_heads": heads,
        "q_lora_rank": None if get("attention.q_lora_rank") is None else int(get("attention.q_lora_rank")),
        "kv_lora_rank": int(get("attention.kv_lora_rank", required=True)), "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": int(get("attention.key_length_mla", required=True)) - rope_dims,
        "v_head_dim": int(get("attention.value_length_mla", required=True)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", required=True)),
        "n_routed_experts": int(get("expert_count", required=True)),
        "num_experts_per_tok": int(get("expert_used_count", required=True)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "routed_scaling_factor": float(np.float32(get("expert_weights_scale", 1.0))),
        "norm_topk_prob": bool(get("expert_weights_norm", False)), "n_group": groups,
        "topk_group": int(get("expert_group_used_count", 1)),
    }  # fmt: skip
    if v3:
        fields["rope_interleave"] = True
    else:
        fields["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    if rope_scaling is not None and (log_multiplier := get("rope.scaling.yarn_log_multiplier")) is not None:
        # DeepSeek's configs set mscale and mscale_all_dim alike; the file keeps only the latter
        mscale = float(np.float32(log_multiplier / _YARN_LOG_MULTIPLIER).round(6))
        fields["rope_scaling"] = rope_scaling | {"mscale": mscale, "mscale_all_dim": mscale}
    config = {key: value for key, value in config.items() if key != "head_dim"}
    return config | fields


def deepseek_hf_name(hf: str) -> str:
    """The router's correction bias is `exp_probs_b.bias` in the file, a bare parameter in HF."""
    return hf.replace("e_score_correction_bias.bias", "e_score_correction_bias")


def deepseek_transform(kind: str, shape: tuple[int, ...]
                       ) -> tuple[tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None, bool]:
    """(HF shape, transform, whether it transposes) of the per-head halves of kv_b_proj."""
    if kind == "attn_k_b":  # [H, kv_lora_rank, qk_nope] -> each head's rows back: [H * qk_nope, kv_lora_rank]
        heads, rank, nope = shape
        return (heads * nope, rank), lambda w: w.transpose(0, 2, 1).reshape(heads * nope, rank), True
    if kind == "attn_v_b":  # [H, v_head_dim, kv_lora_rank]: rows of blocks stay rows
        return (shape[0] * shape[1], shape[2]), lambda w: w.reshape(-1, w.shape[-1]), False
    return shape, None, False
