"""llama.cpp's Gemma architectures (gemma2, gemma3, gemma4) in Hugging Face terms: what their GGUF
metadata leaves to llama.cpp's own assumptions, their extra tensor names, and Gemma 2/3's norms,
which convert_hf_to_gguf stores as the (1 + w) they scale by. loader/gguf_architectures.py asks
here for anything Gemma."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

GEMMA_ARCHITECTURES: tuple[str, ...] = ("gemma2", "gemma3", "gemma4")

# llama.cpp fixes these where transformers' configs carry them: the global/sliding layer pattern
# (where the file has no sliding_window_pattern) and the sliding layers' rope base.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_LOCAL_ROPE_BASE = 10000.0
# Gemma's 27B models scale queries by hidden / heads instead of head_dim (llama.cpp keys this on
# the layer count; transformers reads query_pre_attn_scalar)
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# norms after attention and the MLP too; ffn_norm is the one before the MLP
_BLOCK_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma 4's per-layer embeddings and output scale
_GEMMA4_BLOCK_NAMES = {"inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                       "post_norm": "post_per_layer_input_norm", "layer_output_scale": "layer_scalar"}
_GEMMA4_GLOBAL_NAMES = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                        "per_layer_model_proj": "model.per_layer_model_projection",
                        "per_layer_proj_norm": "model.per_layer_projection_norm"}

Get = Callable[..., Any]


def gemma_block_names(arch: str, llama_names: dict[str, str]) -> dict[str, str]:
    return llama_names | _BLOCK_NAMES | (_GEMMA4_BLOCK_NAMES if arch == "gemma4" else {})


def gemma_global_names(arch: str, llama_names: dict[str, str]) -> dict[str, str]:
    return llama_names | (_GEMMA4_GLOBAL_NAMES if arch == "gemma4" else {})


def gemma_hf_name(hf_name: str) -> str:
    """Gemma 4's layer_scalar is a buffer: no `.weight` in its HF name (llama.cpp adds one)."""
    return hf_name.removesuffix(".weight") if hf_name.endswith(".layer_scalar.weight") else hf_name


def gemma_norm_transform(arch: str, hf_name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """Gemma 2/3 norms back from the stored 1 + w to w (exact: w + 1 recomputes the stored value)."""
    return minus_one if arch != "gemma4" and hf_name.endswith("norm.weight") else None


def minus_one(w: np.ndarray) -> np.ndarray:
    """A (1 + w) scale as stored back to w."""
    return w - np.float32(1.0)


def gemma_config(arch: str, get: Get, get_float: Get, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                 rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """config (the Llama-like fields build_config read) with what a Gemma file adds: windows, layer
    types, soft-caps, query scale, rope per layer type and (Gemma 4) its per-layer shapes."""
    layers = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", _SWA_PATTERN.get(arch, 6))
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
    config |= {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
               "sliding_window": int(get("attention.sliding_window", 4096)),
               "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
               "final_logit_softcapping": get_float("final_logit_softcapping")}
    if arch == "gemma4":
        return _gemma4_config(get, get_float, config, shapes, rope_freqs)
    head_dim = config["head_dim"]
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] \
        if layers == _27B_LAYERS[arch] else head_dim
    if arch == "gemma2":
        return config | {"attn_logit_softcapping": get_float("attn_logit_softcapping")}
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta"), **config.pop("rope_scaling", {})}
    full.pop("type", None)
    local = {"rope_type": "default", "rope_theta": get_float("rope.freq_base_swa") or _LOCAL_ROPE_BASE}
    return config | {"rope_parameters": {"full_attention": full, "sliding_attention": local}}


def _gemma4_config(get: Get, get_float: Get, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                   rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """Global layers have their own head dim (key_length; key_length_swa is the sliding layers')
    and, as lists per layer, KV heads and MLP widths; a global layer without attn_v takes its values
    from the key projection. rope_freqs marks the global layers' unrotated pairs (1e30): proportional
    rope over the pairs marked 1."""
    layers, kinds = config["num_hidden_layers"], config["layer_types"]

    def per_layer(value: int | list[int]) -> list[int]:
        return value if isinstance(value, list) else [value] * layers

    kv_heads, widths = per_layer(get("attention.head_count_kv")), per_layer(get("feed_forward_length"))
    first_full, first_sliding = kinds.index("full_attention"), kinds.index("sliding_attention")
    global_dim = int(get("attention.key_length"))
    rotated = global_dim // 2 if rope_freqs is None else int(np.count_nonzero(rope_freqs == 1.0))
    k_eq_v = f"blk.{first_full}.attn_v.weight" not in shapes
    config.pop("rope_scaling", None)
    return config | {
        "head_dim": int(get("attention.key_length_swa", global_dim)), "global_head_dim": global_dim,
        "num_key_value_heads": int(kv_heads[first_sliding]), "attention_k_eq_v": k_eq_v,
        "num_global_key_value_heads": int(kv_heads[first_full]) if k_eq_v else None,
        "num_kv_shared_layers": int(get("attention.shared_kv_layers", 0)),
        "intermediate_size": int(widths[0]), "use_double_wide_mlp": len(set(widths)) > 1,
        "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": shapes.get("per_layer_token_embd.weight", (config["vocab_size"],))[0],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": config.pop("rope_theta"),
                               "partial_rotary_factor": 2 * rotated / global_dim},
            "sliding_attention": {"rope_type": "default", "rope_theta": get_float("rope.freq_base_swa")
                                  or _LOCAL_ROPE_BASE}},
    }  # fmt: skip
