"""gpt-oss's config.json: alternating sliding and full attention with sinks, a biased router over
experts with the clamped SwiGLU, read without transformers (models/config.py builds ModelConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

GPT_OSS_FAMILY = ("gpt_oss",)

# What transformers' GptOssConfig assumes for fields a config.json leaves out.
GPT_OSS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_oss": {"rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": True,
                "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                "sliding_window": 128, "layer_types": None, "num_local_experts": 128, "num_experts_per_tok": 4,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped above at `limit`, up at ±limit, then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float
    limit: float


def gpt_oss_layer_types(get: Callable[[str], Any]) -> tuple[str, ...]:
    """transformers' default: even layers slide, odd ones attend the whole context."""
    layers = get("num_hidden_layers")
    return tuple(get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                        for i in range(layers)])


def gpt_oss_fields(raw: dict[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    """ModelConfig's fields for a gpt-oss config.json, but its MoeLayout (models/config.py's)."""
    if (raw.get("quantization_config") or {}).get("quant_method") not in (None, "mxfp4"):
        raise ValueError(f"gpt_oss quantization {raw['quantization_config']['quant_method']!r} is not supported "
                         "(MXFP4 experts are dequantized at load)")
    num_heads = get("num_attention_heads")
    layer_types = gpt_oss_layer_types(get)
    return dict(
        model_type="gpt_oss", vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"), num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads") or num_heads, head_dim=get("head_dim"),
        intermediate_size=get("intermediate_size"), max_position_embeddings=get("max_position_embeddings"),
        norm_eps=get("rms_norm_eps"), tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")), o_proj_bias=bool(get("attention_bias")),
        hidden_act=get("hidden_act"), raw_config=raw, layer_types=layer_types, attention_sinks=True,
        sliding_windows=tuple(get("sliding_window") if kind == "sliding_attention" else None for kind in layer_types),
        clamped_swiglu=ClampedSwiglu(get("swiglu_alpha"), get("swiglu_limit")))
