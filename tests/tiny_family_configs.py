"""tiny_models' configs of the families with more to set than a Llama's: the mixtures of experts,
Gemma 2/3/4, DeepSeek, gpt-oss and the hybrid linear-attention families, each from the tests' common tiny shape."""
from __future__ import annotations

from typing import Any


def moe_config(arch: str, common: dict[str, Any]) -> Any:
    """Qwen3-MoE: a dense first layer (mlp_only_layers), renormalised top-2; Qwen2-MoE: a shared
    expert, a dense layer by decoder_sparse_step, unnormalised top-2; Mixtral; OLMoE: q/k norm
    across heads, clip_qkv that bites, top-3."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
                              rope_theta=1_000_000.0, tie_word_embeddings=False)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=2,
                              norm_topk_prob=False, tie_word_embeddings=False)
    if arch == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                             tie_word_embeddings=False)
    return OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=3, clip_qkv=1.5,
                       tie_word_embeddings=False)


# Gemma: the tests' sliding window, a query scalar other than head_dim, soft-caps small enough to
# bite, non-default rope bases (Gemma 3: linear scaling on global layers).


def gemma_config(arch: str, common: dict[str, Any], sliding_window: int) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig, Gemma4TextConfig

    gemma = {**common, "head_dim": 16, "sliding_window": sliding_window, "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        return Gemma2Config(**gemma, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                            final_logit_softcapping=12.0, rope_theta=20000.0, tie_word_embeddings=False)
    if arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}}
        return Gemma3TextConfig(**{**gemma, "num_hidden_layers": 3}, query_pre_attn_scalar=24, rope_parameters=rope,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                tie_word_embeddings=True)
    # Gemma 4: global layers of another head shape with values from the key projection, the last
    # layer reusing layer 1's K/V with a double-wide MLP, per-layer embeddings, proportional rope.
    return Gemma4TextConfig(**{**gemma, "num_hidden_layers": 3}, global_head_dim=32, num_global_key_value_heads=1,
                            attention_k_eq_v=True, num_kv_shared_layers=1, use_double_wide_mlp=True,
                            hidden_size_per_layer_input=8, vocab_size_per_layer_input=common["vocab_size"],
                            layer_types=["sliding_attention", "full_attention", "full_attention"],
                            final_logit_softcapping=5.0, tie_word_embeddings=False)


# DeepSeek: latent attention with small ranks, 4 experts (top 2) and a shared one after a dense first
# layer; V2-Lite's q straight from the hidden state, V3's through its own rank, YaRN with mscale.
def deepseek_config(arch: str, common: dict[str, Any]) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    deepseek = {**common, "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                "tie_word_embeddings": False}
    if arch == "deepseek_v2_lite":  # group-limited: the best 2 of 4 one-expert groups
        return DeepseekV2Config(**deepseek, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                topk_group=2, routed_scaling_factor=1.5, rope_theta=20000.0)
    return DeepseekV3Config(**deepseek, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                             "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})


# gpt-oss: sliding then full attention with sinks, 8 experts (top 2) with a SwiGLU clamp low enough
# to bite, YaRN from an original 64 positions (shorter than the test prompts and their replies).
def gpt_oss_config(common: dict[str, Any], sliding_window: int) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**{**common, "intermediate_size": 32}, head_dim=16, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=sliding_window, swiglu_limit=1.5,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 64,
                                         "rope_theta": 150000.0},
                        tie_word_embeddings=False)


def hybrid_config(arch: str, common: dict[str, Any]) -> Any:
    """3 Gated DeltaNet layers + 1 gated full-attention layer; 2 key heads shared by 4 value heads, a
    conv kernel of 4, a quarter of each full-attention head rotating (8 of 32 dims). Qwen3-Next: a
    dense layer (mlp_only_layers) among sparse ones, renormalised top-2 of 8 experts and a shared
    expert; Qwen3.5-MoE: every layer sparse, top-3."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    hybrid = {**common, "num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
              "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
              "tie_word_embeddings": False}
    experts = {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    if arch == "qwen3_next":
        return Qwen3NextConfig(**hybrid, **experts, num_experts_per_tok=2, mlp_only_layers=[1])
    if arch == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**{k: v for k, v in hybrid.items() if k != "intermediate_size"}, **experts,
                                    num_experts_per_tok=3)
    return Qwen3_5TextConfig(**hybrid)
