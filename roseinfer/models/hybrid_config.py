"""The hybrid linear-attention families' config.json (Qwen3.5 dense, Qwen3-Next, Qwen3.5-MoE): which
layers are Gated DeltaNet, their shape, and the rotary of the full-attention layers, read without
transformers (models/config.py builds ModelConfig from them, and the mixture of experts' layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

HYBRID_FAMILY = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
# the hybrids whose MLP is a mixture of experts with a gated shared expert (models/moe.py)
HYBRID_MOE_FAMILY = ("qwen3_next", "qwen3_5_moe_text")

_COMMON = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
           "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768, "rope_parameters": None,
           "rope_theta": 10000.0, "layer_types": None, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "num_attention_heads": 16}
_MOE = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "intermediate_size": None}
# What transformers' config classes assume for fields a config.json leaves out.
HYBRID_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {**_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3_next": {**_COMMON, **_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                   "num_hidden_layers": 48, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": []},
    # Qwen3.5-MoE has no dense layers and always renormalises its top-k
    "qwen3_5_moe_text": {**_COMMON, **_MOE, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                         "num_experts": 256, "num_experts_per_tok": 8},
}


@dataclass
class LinearAttentionShape:
    """A Gated DeltaNet layer's shape (transformers' linear_* fields): its per-request state is a
    recurrent state [v_heads, k_head_dim, v_head_dim] and a conv state [conv_dim, conv_kernel - 1]."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


def hybrid_fields(raw: dict[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    """ModelConfig's fields for a hybrid: every `full_attention_interval`-th layer gated full attention,
    the others Gated DeltaNet; a quarter of each full-attention head rotates unless the config says."""
    layers = get("num_hidden_layers")
    interval = get("full_attention_interval")
    layer_types = tuple(get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                               for i in range(layers)])
    rope = {"rope_type": "default", "rope_theta": get("rope_theta"), "partial_rotary_factor": 0.25,
            **(get("rope_parameters") or {})}
    return dict(
        model_type=raw["model_type"], vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=layers,
        num_heads=get("num_attention_heads"), num_kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
        intermediate_size=get("intermediate_size") or 0, max_position_embeddings=get("max_position_embeddings"),
        norm_eps=get("rms_norm_eps"), tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")), qk_norm=True, hidden_act=get("hidden_act"),
        raw_config={**raw, "rope_parameters": rope}, layer_types=layer_types,
        linear_attention=LinearAttentionShape(get("linear_num_key_heads"), get("linear_num_value_heads"),
                                              get("linear_key_head_dim"), get("linear_value_head_dim"),
                                              get("linear_conv_kernel_dim")))
