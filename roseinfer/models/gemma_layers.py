"""What the Gemma models (models/gemma.py) compute differently from the Llama family's layers: their
RMSNorm, a layer's view of the KV pool, and the text model's names inside multimodal checkpoints."""
from __future__ import annotations

import torch

from roseinfer.layers.attention import KVCache
from roseinfer.layers.norm import RMSNorm

# where a multimodal checkpoint keeps its text model, and what it holds besides
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_NON_TEXT = ("vision_tower.", "multi_modal_projector.", "embed_vision.", "audio_tower.", "embed_audio.")


class GemmaRMSNorm(RMSNorm):
    """Normalised in float32 and scaled by (w + weight_offset) there before the cast back: Gemma 2
    and 3 store w around 0 (offset 1), Gemma 4 around 1 (offset 0). The CPU backend's C norm leaves
    this class alone (it swaps exact RMSNorm instances only)."""

    def __init__(self, dim: int, eps: float, weight_offset: float) -> None:
        super().__init__(dim, eps)
        self.weight_offset = weight_offset

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalise(x.float(), self.eps, self.weight_offset == 0.0)
                * (self.weight.float() + self.weight_offset)).to(x.dtype)


def rms_normalise(x: torch.Tensor, eps: float, power: bool = True) -> torch.Tensor:
    """x / rms(x) over the last dim, as transformers writes it: Gemma 4 with pow(, -0.5) (`power`),
    Gemma 2 and 3 with rsqrt; the two may round differently."""
    mean_square = x.pow(2).mean(-1, keepdim=True) + eps
    return x * (torch.pow(mean_square, -0.5) if power else torch.rsqrt(mean_square))


def kv_cache_view(cache: KVCache, kv_heads: int, head_dim: int) -> KVCache:
    """A layer's cache in its own head shape. The pool's rows fit the widest layer (ModelConfig); a
    narrower one uses the start of each row's storage, contiguous, as [slots, kv_heads, head_dim]."""
    k, v = cache
    if k.shape[1:] == (kv_heads, head_dim):
        return cache
    slots, width = k.shape[0], kv_heads * head_dim
    if width > k.shape[1] * k.shape[2]:
        raise ValueError(f"a layer's {kv_heads} x {head_dim} KV heads do not fit the pool's rows {tuple(k.shape[1:])}")
    return k.view(-1)[:slots * width].view(slots, kv_heads, head_dim), v.view(-1)[:slots * width].view(
        slots, kv_heads, head_dim)


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model (a multimodal checkpoint's text tensors renamed),
    or None for a tensor of its vision or audio towers."""
    for prefix, text in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text + name[len(prefix):]
    stripped = name.removeprefix("model.")
    return None if stripped.startswith(_NON_TEXT) else name
