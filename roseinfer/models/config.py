"""The model facts the engine needs, read once from a checkpoint's config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roseinfer.layers.rope_parameters import long_rope_original_positions
from roseinfer.models.deepseek_config import (DEEPSEEK_DEFAULTS, DEEPSEEK_FAMILY, DeepseekMoeLayout, MlaLayout,
                                              deepseek_layouts)
from roseinfer.models.gemma_config import GEMMA_DEFAULTS, Gemma4Layout, gemma4_head_shapes, gemma_layer_types, gemma_rope
from roseinfer.models.gpt_oss_config import GPT_OSS_DEFAULTS, GPT_OSS_FAMILY, ClampedSwiglu, gpt_oss_fields
from roseinfer.models.hybrid_config import (HYBRID_DEFAULTS, HYBRID_FAMILY, HYBRID_MOE_FAMILY, LinearAttentionShape,
                                            hybrid_fields)

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3")
GEMMA_FAMILY = ("gemma2", "gemma3_text", "gemma4_text")
# softmax-routed mixture-of-experts families on the Llama layer stack (models/moe.py)
MOE_FAMILY = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
# multimodal checkpoints whose text model is read from their `text_config`
MULTIMODAL_WRAPPERS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
                       "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_MODEL_TYPES = (("gpt2",) + LLAMA_FAMILY + MOE_FAMILY + GEMMA_FAMILY + DEEPSEEK_FAMILY + HYBRID_FAMILY
                         + GPT_OSS_FAMILY + tuple(MULTIMODAL_WRAPPERS))


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
    raw_config: dict[str, Any] = field(default_factory=dict)  # config.json (a wrapper's text_config), for rotary
    # per layer: its attention's sliding window (layers/attention.py PagedAttention), None where it
    # attends the whole context; empty: no layer slides
    sliding_windows: tuple[int | None, ...] = ()
    # per layer "sliding_attention" or "full_attention" (HF's names, Gemma's rope tables); empty: all full
    layer_types: tuple[str, ...] = ()
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    gemma4: Gemma4Layout | None = None
    # DeepSeek: latent attention, whose KV pool row is one head of mla.cache_width (num_kv_heads 1,
    # head_dim that width) with no separate V plane; and the mixture of experts after the dense layers
    mla: MlaLayout | None = None
    deepseek_moe: DeepseekMoeLayout | None = None
    linear_attention: LinearAttentionShape | None = None  # hybrid models: the layer_types "linear_attention"
    moe: MoeLayout | None = None
    # OLMoE: q and k normed over all heads at once (not per head), and q/k/v clamped to ±clip_qkv
    qk_norm_across_heads: bool = False
    clip_qkv: float | None = None
    # the attention output projection has a bias (Llama's attention_bias; Qwen2's covers q/k/v only)
    o_proj_bias: bool = False
    # gpt-oss: a learned logit per query head in every softmax's denominator (layers/attention.py),
    # and its experts' activation
    attention_sinks: bool = False
    clamped_swiglu: ClampedSwiglu | None = None

    @property
    def kv_cache_planes(self) -> int:
        """Tensors per layer in the KV pool: K and V, or the one latent row MLA keys and values read."""
        return 1 if self.mla is not None else 2

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers whose per-request state lives in the state pool (engine/state_pool.py)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        """The layers whose K/V the paged pool holds."""
        return self.num_layers - len(self.linear_layers)

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
        """Reads config.json directly: importing transformers' config classes would pull its heavy
        modules into every process. Missing optional fields take transformers' defaults
        (`_DEFAULTS`; tests/test_model_config.py checks them against transformers)."""
        model_type = raw.get("model_type")
        if model_type in MULTIMODAL_WRAPPERS:
            raw = _text_config(raw, MULTIMODAL_WRAPPERS[model_type], not model_type.startswith("qwen3_5"))
            model_type = raw["model_type"]
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
        if model_type in GEMMA_FAMILY:
            return _gemma_config(cls, raw, get)
        if model_type in DEEPSEEK_FAMILY:
            return _deepseek_config(cls, raw, get)
        if model_type in HYBRID_FAMILY:
            return cls(**hybrid_fields(raw, get), moe=_moe_layout(get))
        if model_type in GPT_OSS_FAMILY:  # every layer's MLP the mixture, softmax over the top-k logits
            moe = MoeLayout(num_experts=get("num_local_experts"), top_k=get("num_experts_per_tok"),
                            expert_width=get("intermediate_size"), norm_topk_prob=True, shared_expert_width=0,
                            sparse_layers=tuple(range(get("num_hidden_layers"))))
            return cls(**gpt_oss_fields(raw, get), moe=moe)
        num_heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // num_heads
        attention_bias = bool(get("qkv_bias") if model_type == "qwen2_moe" else get("attention_bias"))
        return cls(
            model_type=model_type, vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            num_layers=get("num_hidden_layers"), num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=get("intermediate_size"), max_position_embeddings=get("max_position_embeddings"), norm_eps=get("rms_norm_eps"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=attention_bias or model_type == "qwen2",
            o_proj_bias=attention_bias and model_type in ("llama", "mistral", "smollm3", "olmoe", "qwen3_moe"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"), qk_norm_across_heads=model_type == "olmoe",
            clip_qkv=get("clip_qkv") if model_type == "olmoe" else None, moe=_moe_layout(get),
            hidden_act=get("hidden_act"), raw_config=raw,
            nope_layers=_nope_layers(get) if model_type == "smollm3" else (),
            long_rope_from=long_rope_original_positions(raw),
            sliding_windows=_sliding_windows(get, get("num_hidden_layers")),
        )


def _sliding_windows(get: "_Fields", num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers applies it: Mistral's and Phi-3's `sliding_window` to every
    layer; Qwen2/Qwen3's, under `use_sliding_window`, to the layers `layer_types` names sliding (by
    default those from `max_window_layers` on); SmolLM3's likewise, by default its NoPE layers."""
    model_type = get("model_type")
    if model_type in ("qwen2_moe", "qwen3_moe") and get("use_sliding_window"):
        raise ValueError(f"{model_type} with use_sliding_window is not supported")
    if model_type in ("mistral", "phi3", "mixtral"):
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

_MOE_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                 "use_sliding_window": False, "moe_intermediate_size": None, "shared_expert_intermediate_size": 0}
_DEFAULTS.update({
    "qwen2_moe": {**_LLAMA_DEFAULTS, **_MOE_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 16,
                  "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {**_LLAMA_DEFAULTS, **_MOE_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {**_LLAMA_DEFAULTS, **_MOE_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "num_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
                "norm_topk_prob": True},
    "olmoe": {**_LLAMA_DEFAULTS, **_MOE_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
              "num_experts": 64, "num_experts_per_tok": 8, "clip_qkv": None},
})


@dataclass(frozen=True)
class MoeLayout:
    """A softmax-routed mixture of experts (transformers' Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE)."""
    num_experts: int
    top_k: int
    expert_width: int  # each expert's intermediate size
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1
    shared_expert_width: int  # Qwen2-MoE's and the hybrids' shared expert, scaled by a sigmoid gate (0: none)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture; the others are dense


def _moe_layout(get: _Fields) -> MoeLayout | None:
    """Qwen's `mlp_only_layers` and `decoder_sparse_step` leave some layers dense; Mixtral's and
    OLMoE's experts are `intermediate_size` wide and every layer is sparse."""
    model_type = get("model_type")
    if model_type not in MOE_FAMILY + HYBRID_MOE_FAMILY:
        return None
    layers = get("num_hidden_layers")
    # transformers 5 writes Qwen3-MoE's and Mixtral's count as num_local_experts, the hub's files num_experts
    num_experts = get("num_local_experts" if "num_local_experts" in get.raw else "num_experts")
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        width = get("moe_intermediate_size")
        if model_type == "qwen3_5_moe_text":  # transformers' Qwen3.5-MoE makes every layer sparse
            dense, step = set(), 1
        else:
            dense, step = set(get("mlp_only_layers")), get("decoder_sparse_step")
        sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    else:
        width, sparse = get("intermediate_size"), tuple(range(layers))
    return MoeLayout(num_experts=num_experts, top_k=get("num_experts_per_tok"), expert_width=width,
                     norm_topk_prob=model_type == "qwen3_5_moe_text" or bool(get("norm_topk_prob")),
                     shared_expert_width=(get("shared_expert_intermediate_size")
                                          if model_type in ("qwen2_moe",) + HYBRID_MOE_FAMILY else 0),
                     sparse_layers=sparse)


_DEFAULTS.update(HYBRID_DEFAULTS)
_DEFAULTS.update(GEMMA_DEFAULTS)
_DEFAULTS.update(DEEPSEEK_DEFAULTS)
_DEFAULTS.update(GPT_OSS_DEFAULTS)
def _text_config(raw: dict[str, Any], text_type: str, ties_by_default: bool) -> dict[str, Any]:
    """A multimodal checkpoint's text model config, with the wrapper's tying (HF ties at the top;
    Gemma's wrappers by default, Qwen3.5's not)."""
    text = dict(raw.get("text_config") or {})
    text["model_type"] = text_type
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", ties_by_default))
    return text


def _gemma_config(cls: type[ModelConfig], raw: dict[str, Any], get: _Fields) -> ModelConfig:
    model_type = raw["model_type"]
    layer_types = gemma_layer_types(model_type, raw, get)
    text = {**raw, "layer_types": list(layer_types), "rope_parameters": gemma_rope(model_type, raw, get)}
    head_dim, kv_heads = get("head_dim"), get("num_key_value_heads")
    gemma4 = None
    scale = get("query_pre_attn_scalar") ** -0.5
    if raw.get("use_bidirectional_attention") in (True, "all"):
        raise ValueError(f"{model_type} with use_bidirectional_attention={raw['use_bidirectional_attention']!r} "
                         "attends both ways (an embedding model), not a causal LM; not supported")
    if model_type == "gemma4_text":
        if get("enable_moe_block"):
            raise ValueError("Gemma 4 mixture-of-experts checkpoints (enable_moe_block) are not supported yet")
        shapes = gemma4_head_shapes(raw, get, layer_types)
        gemma4 = Gemma4Layout(
            head_shapes=shapes, k_eq_v=bool(get("attention_k_eq_v")), kv_shared_layers=get("num_kv_shared_layers"),
            per_layer_input_size=get("hidden_size_per_layer_input") or 0,
            per_layer_vocab_size=get("vocab_size_per_layer_input"), double_wide_mlp=bool(get("use_double_wide_mlp")))
        # the KV pool's rows fit the widest layer: a layer of another shape views a prefix of its row
        head_dim = max(dim for _, dim in shapes)
        kv_heads = -(-max(heads * dim for heads, dim in shapes) // head_dim)
        scale = 1.0
    return cls(
        model_type=model_type, vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"), num_heads=get("num_attention_heads"), num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"), norm_eps=get("rms_norm_eps"),
        tie_word_embeddings=bool(get("tie_word_embeddings")), attention_bias=bool(get("attention_bias")),
        qk_norm=model_type != "gemma2", hidden_act=get("hidden_activation"), raw_config=text,
        layer_types=layer_types, attn_scale=scale,
        sliding_windows=tuple(get("sliding_window") if kind != "full_attention" else None for kind in layer_types),
        attn_logit_softcap=get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_logit_softcap=get("final_logit_softcapping"), gemma4=gemma4)


def _deepseek_config(cls: type[ModelConfig], raw: dict[str, Any], get: _Fields) -> ModelConfig:
    mla, moe = deepseek_layouts(raw["model_type"], get)
    return cls(
        model_type=raw["model_type"], vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"), num_heads=get("num_attention_heads"), num_kv_heads=1,
        head_dim=mla.cache_width, intermediate_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"), norm_eps=get("rms_norm_eps"),
        tie_word_embeddings=bool(get("tie_word_embeddings")), attention_bias=bool(get("attention_bias")),
        hidden_act=get("hidden_act"), raw_config=raw, mla=mla, deepseek_moe=moe)


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
