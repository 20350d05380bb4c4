"""Gemma 2 / 3 / 4's config.json: defaults, layer types, rope per layer type and Gemma 4's layer
shapes, read without transformers (models/config.py builds ModelConfig from them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Fields = Callable[[str], Any]

# What transformers' Gemma configs assume for fields a config.json leaves out.
_COMMON = {"hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
           "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
           "sliding_window": 4096, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
           "layer_types": None, "rope_parameters": None, "rope_scaling": None}
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {**_COMMON, "vocab_size": 256000, "num_hidden_layers": 26, "max_position_embeddings": 8192,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0},
    "gemma3_text": {**_COMMON, "vocab_size": 262208, "num_hidden_layers": 26,
                    "max_position_embeddings": 131072, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10000.0},
    "gemma4_text": {**_COMMON, "vocab_size": 262144, "num_hidden_layers": 30,
                    "max_position_embeddings": 131072, "sliding_window": 512, "global_head_dim": 512,
                    "num_global_key_value_heads": None, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                    "use_double_wide_mlp": False, "enable_moe_block": False},
}
# Gemma 4's rope when config.json gives none: proportional rope on a quarter of the global layers' dims
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


@dataclass
class Gemma4Layout:
    """What Gemma 4 adds to a Gemma 3 layer stack (transformers' Gemma4TextConfig)."""
    head_shapes: tuple[tuple[int, int], ...]  # per layer (kv heads, head dim): global layers' differ
    k_eq_v: bool  # global layers have no v_proj: values are the keys' projection
    kv_shared_layers: int  # the last this many layers attend to an earlier layer's K/V of their type
    per_layer_input_size: int  # per-layer embeddings (0: none)
    per_layer_vocab_size: int
    double_wide_mlp: bool  # KV-shared layers' MLPs are twice as wide


def gemma4_head_shapes(raw: dict[str, Any], get: Fields,
                        layer_types: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """transformers 5 writes each global layer's shape into `per_layer_config`; older files give
    global_head_dim and (where k_eq_v) num_global_key_value_heads."""
    shapes = []
    for i, kind in enumerate(layer_types):
        heads, dim = get("num_key_value_heads"), get("head_dim")
        if "per_layer_config" in raw:
            override = raw["per_layer_config"].get(str(i), {})
            heads, dim = override.get("num_key_value_heads", heads), override.get("head_dim", dim)
        elif kind == "full_attention":
            global_heads = get("num_global_key_value_heads") if get("attention_k_eq_v") else None
            heads, dim = global_heads or heads, get("global_head_dim")
        shapes.append((heads, dim))
    return tuple(shapes)


def gemma_layer_types(model_type: str, raw: dict[str, Any], get: Fields) -> tuple[str, ...]:
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:  # Gemma 2 alternates; Gemma 3 and 4 have one global layer in every `pattern`
        pattern = 2 if model_type == "gemma2" else raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if model_type == "gemma4_text":
        types = [*types[:-1], "full_attention"]  # transformers forces the last layer global
    return tuple(types)


def gemma_rope(model_type: str, raw: dict[str, Any], get: Fields) -> dict[str, dict[str, Any]]:
    """Rope parameters per layer type, from transformers 5's `rope_parameters` or the older
    rope_theta / rope_local_base_freq / rope_scaling fields."""
    params = get("rope_parameters")
    if model_type == "gemma2":
        theta = (params or {}).get("rope_theta", get("rope_theta"))
        return {kind: {"rope_type": "default", "rope_theta": theta}
                for kind in ("sliding_attention", "full_attention")}
    if model_type == "gemma4_text":
        return params or _GEMMA4_ROPE
    if params and "full_attention" in params:
        return params
    full = {**(get("rope_scaling") or {}), "rope_theta": get("rope_theta")}
    full["rope_type"] = full.pop("rope_type", None) or full.pop("type", "default")
    full.pop("type", None)
    return {"full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": get("rope_local_base_freq")}}
