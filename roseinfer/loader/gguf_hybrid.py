"""llama.cpp's hybrid linear-attention architectures (qwen3next, qwen35, qwen35moe) in Hugging Face
terms: the Gated DeltaNet shape its ssm.* metadata carries, the tensor names, and what
convert_hf_to_gguf changed in them: norms stored as the (1 + w) they scale by (the gated norm
excepted), A_log stored as A = -exp(A_log), dt_bias renamed ssm_dt.bias, the conv weight squeezed, and
for qwen35 / qwen35moe the value heads reordered from grouped by key head to tiled (ggml broadcasts
the key heads that way). Here each is undone; loader/gguf_architectures.py asks here for anything
hybrid.

Qwen3-Next's file splits its fused in_proj_qkvz into attn_qkv and attn_gate (Qwen3.5's separate
projections) and keeps in_proj_ba whole (ssm_ba): its converted folder loads in roseinfer
(models/qwen3_5.py splits in_proj_ba), not in transformers, whose Qwen3-Next wants in_proj_qkvz.
Nor does transformers 5 read Qwen3.5-MoE's experts stacked per projection (`mlp.experts.gate_proj`,
as every GGUF conversion writes them): of the three, only dense Qwen3.5's fp32 folder loads there."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from roseinfer.loader.gguf_gemma import minus_one

HYBRID_ARCHITECTURES: tuple[str, ...] = ("qwen3next", "qwen35", "qwen35moe")
HYBRID_HF_CLASSES = {"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                     "qwen35moe": "Qwen3_5MoeForCausalLM"}
HYBRID_MODEL_TYPES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}

# GGUF per-block tensor name -> HF name inside `model.layers.N.`, beside the Llama and MoE ones
_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}  # fmt: skip
# stored without .weight, or renamed: the HF parameter's full name inside the layer
_PARAMETER_NAMES = {("ssm_a", ""): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
_UNIT_OFFSET_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")

Transform = Callable[[np.ndarray], np.ndarray]
Get = Callable[..., Any]


def hybrid_block_names(names: dict[str, str]) -> dict[str, str]:
    return names | _BLOCK_NAMES


def hybrid_parameter_name(kind: str, suffix: str) -> str | None:
    """The HF name inside the layer of a tensor stored under another suffix (ssm_a, ssm_dt.bias)."""
    return _PARAMETER_NAMES.get((kind, suffix))


def hybrid_config(arch: str, get: Get, config: dict[str, Any]) -> dict[str, Any]:
    """config (the Llama-like fields build_config read) with the linear layers' shape, the layer
    pattern, the full layers' partial rotary; multi-token-prediction blocks are not counted."""
    head_dim, value_heads = config["head_dim"], int(get("ssm.time_step_rank"))
    layers = config["num_hidden_layers"] - int(get("nextn_predict_layers", 0))
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 4)) / head_dim}
    config |= {"num_hidden_layers": layers, "full_attention_interval": int(get("full_attention_interval", 4)),
               "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "linear_key_head_dim": int(get("ssm.state_size")),
               "linear_num_key_heads": int(get("ssm.group_count")), "linear_num_value_heads": value_heads,
               "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads, "rope_parameters": rope}
    if arch == "qwen35moe":  # every layer a mixture: transformers' config has no dense width
        config.pop("intermediate_size")
    if arch != "qwen35":  # both renormalise their top-k
        config["norm_topk_prob"] = True
    return config


def hybrid_transform(arch: str, kind: str, config: dict[str, Any],
                     shape: tuple[int, ...]) -> tuple[Transform | None, tuple[int, ...], bool]:
    """(transform, HF shape, whether it acts on columns) that undoes the converter for one tensor."""
    if kind in _UNIT_OFFSET_NORMS:
        return minus_one, shape, False
    if kind == "ssm_a":  # A = -exp(A_log)
        return _then(_log_of_negated, _tiled_to_grouped(arch, config, 1)), shape, False
    untile = _tiled_to_grouped(arch, config, config["linear_value_head_dim"])
    if kind == "ssm_conv1d":  # [channels, kernel] -> HF's [channels, 1, kernel]; the v channels untiled
        value_from = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
        return _then(_on_rows_from(value_from, untile), _insert_axis_1), (shape[0], 1, shape[1]), False
    if kind == "attn_qkv":
        value_from = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
        return _on_rows_from(value_from, untile), shape, False
    if kind == "attn_gate":
        return untile, shape, False
    if kind in ("ssm_beta", "ssm_alpha", "ssm_dt"):
        return _tiled_to_grouped(arch, config, 1), shape, False
    if kind == "ssm_out":
        return _on_columns(untile), shape, True
    return None, shape, False


def _tiled_to_grouped(arch: str, config: dict[str, Any], head_dim: int) -> Transform:
    """Rows [per_k, k_heads, head_dim] (tiled) -> [k_heads, per_k, head_dim] (grouped by key head);
    Qwen3-Next's file and equal head counts keep transformers' order."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if arch == "qwen3next" or k_heads == v_heads:
        return _identity
    per_k = v_heads // k_heads

    def fn(w: np.ndarray) -> np.ndarray:
        return w.reshape(per_k, k_heads, head_dim, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)

    return fn


def _on_rows_from(start: int, fn: Transform) -> Transform:
    return lambda w: np.concatenate([w[:start], fn(w[start:])])


def _on_columns(fn: Transform) -> Transform:
    return lambda w: np.ascontiguousarray(fn(w.T).T)


def _then(first: Transform, second: Transform) -> Transform:
    return lambda w: second(first(w))


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _insert_axis_1(w: np.ndarray) -> np.ndarray:
    return w[:, None, :]


def _log_of_negated(w: np.ndarray) -> np.ndarray:
    return np.log(-w.astype(np.float64)).astype(np.float32)
