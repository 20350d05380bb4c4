"""DeepSeek-V2 / V3's config.json: multi-head latent attention's ranks and head widths, and the
mixture of experts' routing, read without transformers (models/config.py builds ModelConfig from them)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from roseinfer.layers.deepseek_layouts import DeepseekRouting, MlaLayout
from roseinfer.layers.rope_parameters import rope_parameters

DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3")

# What transformers' DeepseekV2Config / DeepseekV3Config assume for fields a config.json leaves out.
_COMMON = {"quantization_config": None, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
           "num_key_value_heads": None, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128}
DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_COMMON, "max_position_embeddings": 2048, "first_k_dense_replace": 0, "n_group": None,
                    "topk_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy", "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "deepseek_v3": {**_COMMON, "max_position_embeddings": 4096, "first_k_dense_replace": 3, "n_group": 8,
                    "topk_group": 4, "n_routed_experts": 256, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True,
                    "rope_interleave": True},
}


@dataclass(frozen=True)
class DeepseekMoeLayout:
    routing: DeepseekRouting
    expert_size: int  # each routed expert's MLP width
    shared_size: int  # the shared experts' MLP width, all of them in one MLP (0: none)
    first_moe_layer: int  # layers before it are dense (first_k_dense_replace)


def deepseek_layouts(model_type: str, get: Callable[[str], Any]) -> tuple[MlaLayout, DeepseekMoeLayout]:
    quantization = get("quantization_config") or {}
    if quantization.get("quant_method") == "fp8":
        # DeepSeek's own V3 release: 128 x 128 fp8 blocks with weight_scale_inv tensors beside them
        raise ValueError(f"{model_type} with fp8 block-quantized weights is not supported; use a bf16 or fp32 "
                         "conversion of the checkpoint")
    v3 = model_type == "deepseek_v3"
    mla = MlaLayout(get("q_lora_rank"), get("kv_lora_rank"), get("qk_nope_head_dim"), get("qk_rope_head_dim"),
                    get("v_head_dim"), rope_in_halves=v3 and not get("rope_interleave"))
    method = "group_limited" if v3 else get("topk_method")
    if method not in ("greedy", "group_limited_greedy", "group_limited"):
        raise ValueError(f"deepseek_v2 topk_method {method!r} is not supported; supported: greedy, "
                         "group_limited_greedy")
    grouped = method != "greedy"
    routing = DeepseekRouting(
        num_experts=get("n_routed_experts"), top_k=get("num_experts_per_tok"),
        scoring="sigmoid" if v3 else "softmax", num_groups=get("n_group") if grouped else 1,
        top_groups=get("topk_group") if grouped else 1, group_by="top2" if v3 else "max",
        normalise=bool(get("norm_topk_prob")) if v3 else False,  # transformers' V2 never renormalises
        scaling_factor=float(get("routed_scaling_factor")))
    moe = DeepseekMoeLayout(routing, get("moe_intermediate_size"),
                            get("moe_intermediate_size") * (get("n_shared_experts") or 0),
                            get("first_k_dense_replace"))
    return mla, moe


def mla_softmax_scale(raw: dict[str, Any], mla: MlaLayout) -> float:
    """transformers' scaling: 1/sqrt(qk head dim), times YaRN's mscale(mscale_all_dim) squared."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    params = rope_parameters(raw)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale
