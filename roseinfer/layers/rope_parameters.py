"""A config.json's rotary settings, read without torch (models/config.py reads them in processes that
never load a model): the rope type and its parameters, how many dims of a head rotate, and where
LongRoPE's long factors take over."""
from __future__ import annotations

from typing import Any

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# transformers' config classes whose rope_theta default is not 10000
_DEFAULT_THETA = {"smollm3": 2_000_000.0, "mixtral": 1_000_000.0, "gpt_oss": 150_000.0}
# the families whose transformers attention rotates only the first partial_rotary_factor of a head
_PARTIAL_ROTARY_MODEL_TYPES = ("phi3", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict:
    """The rope settings of a config.json: `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta` (and top-level `partial_rotary_factor`, as Phi-3 writes it); with
    layer_type, that type's entry of a per-type `rope_parameters` (Gemma 3 and 4)."""
    if layer_type is not None:
        return dict(config["rope_parameters"][layer_type])
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su" or (params["rope_type"] == "yarn" and config.get("model_type") == "phi3"):
        params["rope_type"] = "longrope"  # Phi3Config's reading of its older names
    params.setdefault("rope_theta", config.get("rope_theta", _DEFAULT_THETA.get(config.get("model_type"), 10000.0)))
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return params


def long_rope_original_positions(config: dict[str, Any]) -> int | None:
    """For LongRoPE whose context reaches past its original one: that original length, past which
    transformers rotates a sequence with the long factors (Request.rotates_long)."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    return original if original and config.get("max_position_embeddings", 0) > original else None


def rotary_dim(head_dim: int, config: dict[str, Any]) -> int:
    """The leading dims of each head that rotate (transformers' int(head_dim * partial_rotary_factor))."""
    if config.get("model_type") not in _PARTIAL_ROTARY_MODEL_TYPES:
        return head_dim
    return int(head_dim * rope_parameters(config)["partial_rotary_factor"])
