"""The model facts the engine needs, read once from a checkpoint's config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roseinfer.layers.rope_parameters import long_rope_original_positions

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3")
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
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary (SmolLM3's NoPE layers)
    # LongRoPE (Phi-3/4): a sequence longer than this is rotated with the long factors throughout
    long_rope_from: int | None = None
    raw_config: dict[str, Any] = field(default_factory=dict)  # config.json, for rotary scaling
    # per layer: its attention's sliding window (layers/attention.py PagedAttention), None where it
    # attends the whole context; empty: no layer slides
    sliding_windows: tuple[int | None, ...] = ()

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def kv_window(self) -> int | None:
        """How many trailing positions any layer can still attend to, where every layer slides: the
        KV blocks wholly before that are dead. None where some layer attends the whole context."""
        if len(self.sliding_windows) < self.num_layers or None in self.sliding_windows:
            return None
        return max(self.sliding_windows)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Reads config.json directly: importing transformers' config classes would pull about
        150 MB of modules into every process. Missing optional fields take transformers' defaults
        (`_DEFAULTS`; tests/test_model_config.py checks them against transformers)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        get = _Fields(raw, _DEFAULTS[model_type])
        if model_type == "gpt2":
            return cls(
                model_type="gpt2", vocab_size=get("vocab_size"), hidden_size=get("n_embd"), num_layers=get("n_layer"),
                num_heads=get("n_head"), num_kv_heads=get("n_head"), head_dim=get("n_embd") // get("n_head"),
                intermediate_size=get("n_inner") or 4 * get("n_embd"), max_position_embeddings=get("n_positions"),
                norm_eps=get("layer_norm_epsilon"), tie_word_embeddings=True, attention_bias=True,
                hidden_act=get("activation_function"), raw_config=raw,
            )
        num_heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // num_heads
        return cls(
            model_type=model_type, vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            num_layers=get("num_hidden_layers"), num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=get("intermediate_size"), max_position_embeddings=get("max_position_embeddings"), norm_eps=get("rms_norm_eps"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=bool(get("attention_bias")) or model_type == "qwen2",
            qk_norm=model_type == "qwen3", hidden_act=get("hidden_act"), raw_config=raw,
            nope_layers=_nope_layers(get) if model_type == "smollm3" else (),
            long_rope_from=long_rope_original_positions(raw),
            sliding_windows=_sliding_windows(get, get("num_hidden_layers")),
        )


def _sliding_windows(get: "_Fields", num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers applies it: Mistral's and Phi-3's `sliding_window` to every
    layer; Qwen2/Qwen3's, under `use_sliding_window`, to the layers `layer_types` names sliding (by
    default those from `max_window_layers` on); SmolLM3's likewise, by default its NoPE layers."""
    model_type = get("model_type")
    if model_type in ("mistral", "phi3"):
        return (get("sliding_window"),) * num_layers if get("sliding_window") is not None else ()
    if model_type == "smollm3" and get("use_sliding_window") and get("sliding_window") is not None:
        nope = _nope_layers(get)
        layer_types = get("layer_types") or ["sliding_attention" if i in nope else "full_attention"
                                             for i in range(num_layers)]
        return tuple(get("sliding_window") if kind == "sliding_attention" else None for kind in layer_types)
    if model_type not in ("qwen2", "qwen3") or not get("use_sliding_window") or get("sliding_window") is None:
        return ()
    layer_types = get("layer_types") or ["sliding_attention" if i >= get("max_window_layers") else "full_attention"
                                         for i in range(num_layers)]
    return tuple(get("sliding_window") if kind == "sliding_attention" else None for kind in layer_types)


_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
                   "num_key_value_heads": None, "head_dim": None, "attention_bias": False}
_QWEN_WINDOW_DEFAULTS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
                         "layer_types": None}
# What transformers' config classes assume for fields a config.json leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_positions": 1024},
    "llama": {**_LLAMA_DEFAULTS, "max_position_embeddings": 2048},
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096,
                "num_key_value_heads": 8},
    "qwen2": {**_LLAMA_DEFAULTS, **_QWEN_WINDOW_DEFAULTS, "max_position_embeddings": 32768,
              "num_key_value_heads": 32},
    "qwen3": {**_LLAMA_DEFAULTS, **_QWEN_WINDOW_DEFAULTS, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "head_dim": 128},
    "phi3": {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "sliding_window": None},
    "smollm3": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
                "no_rope_layers": None, "no_rope_layer_interval": 4, "layer_types": None},
}


def _nope_layers(get: "_Fields") -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` holds 1 for a layer that rotates, 0 for one that does not; absent,
    every `no_rope_layer_interval`-th layer does not (transformers' SmolLM3Config)."""
    uses_rope = get("no_rope_layers")
    if uses_rope is None:
        interval = get("no_rope_layer_interval")
        uses_rope = [int((layer + 1) % interval != 0) for layer in range(get("num_hidden_layers"))]
    return tuple(layer for layer, rotates in enumerate(uses_rope) if not rotates)


class _Fields:
    """config.json lookups: the file's value, else the default, else a clear error."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.raw, self.defaults = raw, defaults

    def __call__(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"config.json has no {key!r}, which a {self.raw.get('model_type')} model needs")
