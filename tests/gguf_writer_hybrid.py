"""The hybrid linear-attention models' GGUF tensors and metadata as llama.cpp's convert_hf_to_gguf.py
writes them (its Qwen3NextModel, and Qwen3_5TextModel / Qwen3_5MoeTextModel with their value-head
reordering), for tests/gguf_writer.py: norms stored as 1 + w (the gated norm excepted), A_log as
-exp(A_log), dt_bias as ssm_dt.bias, the conv weight squeezed, Qwen3-Next's in_proj_qkvz split into
attn_qkv and attn_gate; for qwen35 / qwen35moe the value heads tiled instead of grouped by key head."""
from __future__ import annotations

from typing import Any

import gguf
import numpy as np

HYBRID_ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
_LINEAR = {"in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_b": "ssm_beta", "in_proj_a": "ssm_alpha",
           "in_proj_ba": "ssm_ba", "conv1d": "ssm_conv1d", "norm": "ssm_norm", "out_proj": "ssm_out"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def add_hybrid_metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    """Qwen3NextModel.set_gguf_parameters' linear-attention keys, and Qwen3.5's rope sections."""
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    interval = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"][0] + 1
    w.add_full_attention_interval(interval)
    if cfg.model_type != "qwen3_next":  # _Qwen35MRopeMixin: llama.cpp requires the (text-irrelevant) sections
        w.add_rope_dimension_sections(cfg.rope_parameters.get("mrope_section", [11, 11, 10, 0]))


def hybrid_gguf_tensors(state: dict[str, np.ndarray], cfg: Any, names: dict[str, str]) -> dict[str, np.ndarray]:
    """GGUF name -> data: `names` (gguf_writer's HF -> GGUF names) for the Llama-like and MoE tensors,
    the linear layers' tensors and the stored forms of the norms here."""
    tiled = cfg.model_type != "qwen3_next" and cfg.linear_num_key_heads != cfg.linear_num_value_heads
    out: dict[str, np.ndarray] = {}
    for hf_name, data in state.items():
        stem, _, suffix = hf_name.rpartition(".")
        if stem == "model.norm":
            out["output_norm.weight"] = data + np.float32(1.0)
            continue
        if not stem.startswith("model.layers."):
            if hf_name in names:
                out[names[hf_name]] = data
            continue
        layer, _, rest = stem[len("model.layers."):].partition(".")
        blk = f"blk.{layer}"
        if rest in _NORMS:
            out[f"{blk}.{_NORMS[rest]}.weight"] = data + np.float32(1.0)
        elif rest == "linear_attn":  # parameters directly on the layer: A_log, dt_bias
            v_heads = _tile(data, cfg, 1) if tiled else data
            if suffix == "A_log":
                out[f"{blk}.ssm_a"] = -np.exp(v_heads)
            else:
                out[f"{blk}.ssm_dt.bias"] = v_heads
        elif rest.startswith("linear_attn."):
            out.update(_linear_tensor(blk, rest.removeprefix("linear_attn."), data, cfg, tiled))
        elif hf_name in names:
            out[names[hf_name]] = data
    return out


def _linear_tensor(blk: str, part: str, data: np.ndarray, cfg: Any, tiled: bool) -> dict[str, np.ndarray]:
    qk_rows = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    v_dim = cfg.linear_value_head_dim
    if part == "in_proj_qkvz":  # per key head [q, k, v, z] -> q, k, v of every head, then z
        per_k = cfg.linear_num_value_heads // cfg.linear_num_key_heads * v_dim
        k_dim = cfg.linear_key_head_dim
        grouped = data.reshape(cfg.linear_num_key_heads, -1, data.shape[-1])
        q, k, v, z = np.split(grouped, np.cumsum([k_dim, k_dim, per_k])[:3], axis=1)
        rows = [t.reshape(-1, data.shape[-1]) for t in (q, k, v)]
        return {f"{blk}.attn_qkv.weight": np.concatenate(rows), f"{blk}.attn_gate.weight": z.reshape(-1, data.shape[-1])}
    if part == "conv1d":
        data = data[:, 0, :]
        if tiled:
            data = np.concatenate([data[:qk_rows], _tile(data[qk_rows:], cfg, v_dim)])
    elif tiled and part == "in_proj_qkv":
        data = np.concatenate([data[:qk_rows], _tile(data[qk_rows:], cfg, v_dim)])
    elif tiled and part == "in_proj_z":
        data = _tile(data, cfg, v_dim)
    elif tiled and part in ("in_proj_b", "in_proj_a"):
        data = _tile(data, cfg, 1)
    elif tiled and part == "out_proj":
        data = np.ascontiguousarray(_tile(data.T, cfg, v_dim).T)
    return {f"{blk}.{_LINEAR[part]}.weight": data}


def _tile(rows: np.ndarray, cfg: Any, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: rows [k_heads, per_k, d] -> [per_k, k_heads, d]."""
    k_heads = cfg.linear_num_key_heads
    per_k = cfg.linear_num_value_heads // k_heads
    return rows.reshape(k_heads, per_k, head_dim, *rows.shape[1:]).swapaxes(0, 1).reshape(rows.shape)
