"""The shapes of DeepSeek's latent attention (layers/mla.py) and of its routing (layers/deepseek_moe.py),
torch-free: models/deepseek_config.py reads them from config.json in processes that load no model."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlaLayout:
    """Multi-head latent attention's shapes (layers/mla.py). Per token the KV pool holds one row of
    kv_lora_rank + qk_rope_head_dim: the normed latent and the rotated shared key."""
    q_lora_rank: int | None  # None: q straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_in_halves: bool  # V3 with rope_interleave false: HF rotates x[i] with x[i + d/2]

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekRouting:
    """How a DeepSeek MoE layer picks its experts (layers/deepseek_moe.py route)."""
    num_experts: int
    top_k: int
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, with a correction bias for the choice only)
    num_groups: int  # experts fall into this many equal groups; 1: no group limit
    top_groups: int  # the tokens' experts come from the best this many groups
    group_by: str  # a group's score: "max" of its experts (V2) or the sum of its "top2" (V3)
    normalise: bool  # the chosen weights sum to 1 before the scaling factor
    scaling_factor: float
