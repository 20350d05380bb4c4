"""The model facts the engine needs, read once from a transformers config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = ("gpt2",) + LLAMA_FAMILY


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    hf_config: Any = None  # kept for rotary init (transformers computes scaled frequencies)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gpt2":
            return cls(
                model_type="gpt2", vocab_size=hf.vocab_size, hidden_size=hf.n_embd, num_layers=hf.n_layer,
                num_heads=hf.n_head, num_kv_heads=hf.n_head, head_dim=hf.n_embd // hf.n_head,
                intermediate_size=hf.n_inner or 4 * hf.n_embd, max_position_embeddings=hf.n_positions,
                norm_eps=hf.layer_norm_epsilon, tie_word_embeddings=True, attention_bias=True,
                hidden_act=hf.activation_function, hf_config=hf,
            )
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        max_pos = hf.max_position_embeddings
        # Mistral-style sliding window: we attend to the whole context, so cap the context at
        # the window, where both agree.
        window = getattr(hf, "sliding_window", None) if model_type == "mistral" else None
        if window:
            max_pos = min(max_pos, window)
        return cls(
            model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers, num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
            intermediate_size=hf.intermediate_size, max_position_embeddings=max_pos, norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or model_type == "qwen2",
            qk_norm=model_type == "qwen3", hidden_act=getattr(hf, "hidden_act", "silu"), hf_config=hf,
        )
