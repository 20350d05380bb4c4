"""What each GGUF architecture is in Hugging Face terms: the config.json a file's metadata becomes, and
which HF parameter each GGUF tensor fills (renamed, and un-permuted or transposed where llama.cpp's
converter changed its layout). loader/gguf.py drives the conversion."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from roseinfer.loader.gguf_deepseek import (DEEPSEEK_ARCHITECTURES, DEEPSEEK_BLOCK_NAMES, deepseek_config,
                                            deepseek_hf_name, deepseek_transform)
from roseinfer.loader.gguf_gemma import (GEMMA_ARCHITECTURES, gemma_block_names, gemma_config, gemma_global_names,
                                         gemma_hf_name, gemma_norm_transform)
from roseinfer.loader.gguf_hybrid import (HYBRID_ARCHITECTURES, HYBRID_HF_CLASSES, HYBRID_MODEL_TYPES,
                                          hybrid_block_names, hybrid_config, hybrid_parameter_name, hybrid_transform)

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3",
                                           "smollm3", "qwen2moe", "qwen3moe", "olmoe", "gpt-oss") + GEMMA_ARCHITECTURES + \
    DEEPSEEK_ARCHITECTURES + HYBRID_ARCHITECTURES

# GGUF per-block tensor name -> HF name inside `model.layers.N.` (llama-like families).
_LLAMA_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
# Mixtures of experts: the router, each projection of every expert stacked [E, out, in] (loaded by
# models/moe_llama.py), Qwen2-MoE's shared expert and its gate.
_MOE_BLOCK_NAMES: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}  # fmt: skip
# gpt-oss: a norm after attention, the sinks (which transformers names without .weight), the router
# with its bias, and the experts' projections and biases stacked [E, out, in] / [E, out] (loaded by
# models/gpt_oss.py); its MXFP4 experts keep their blocks where the backend computes with them, as any
# other kept type.
_GPT_OSS_BLOCK_NAMES: dict[str, str] = {
    **_LLAMA_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}  # fmt: skip
# Phi-3 keeps its checkpoint's fused q/k/v and gate/up (ffn_up holds gate then up).
_PHI3_BLOCK_NAMES: dict[str, str] = {**_LLAMA_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LLAMA_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF per-block tensor name -> HF name inside `transformer.h.N.` (gpt2).
_GPT2_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}  # fmt: skip
_GPT2_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f", "output": "lm_head",
}  # fmt: skip
# HF GPT-2 uses Conv1D layers that store weights as (in, out); llama.cpp transposes
# them to the usual (out, in), so they must be transposed back.
_GPT2_CONV1D = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})
# Tensors that have no HF parameter. rope_freqs carries llama3-style rope factors that
# HF expresses through rope_scaling instead; we cannot recover those parameters
# exactly, so the tensor is dropped with a warning. Phi-3's LongRoPE factors become its
# config's rope_scaling (build_config's `rope_factors`).
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight", *ROPE_FACTOR_TENSORS})
_HF_CLASSES: dict[str, str] = dict(llama="LlamaForCausalLM", mistral="MistralForCausalLM",
                                    qwen2="Qwen2ForCausalLM", qwen3="Qwen3ForCausalLM", gpt2="GPT2LMHeadModel",
                                    phi3="Phi3ForCausalLM", smollm3="SmolLM3ForCausalLM",
                                    gemma2="Gemma2ForCausalLM", gemma3="Gemma3ForCausalLM",
                                    gemma4="Gemma4ForCausalLM", qwen2moe="Qwen2MoeForCausalLM",
                                    qwen3moe="Qwen3MoeForCausalLM", olmoe="OlmoeForCausalLM",
                                    mixtral="MixtralForCausalLM", deepseek2="DeepseekV2ForCausalLM",
                                    **{"gpt-oss": "GptOssForCausalLM"}) | HYBRID_HF_CLASSES
_HF_MODEL_TYPES: dict[str, str] = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe",
                                   "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"} | HYBRID_MODEL_TYPES
# the hybrids' ssm_a is stored without a suffix
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class TensorPlan:
    """How one GGUF tensor becomes one HF tensor."""
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dimensions reversed)
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    on_columns: bool = False  # the transform moves columns (a transpose): it cannot act on rows of blocks
    blocks: tuple[str, int] | None = None  # (GGML type, bytes per row) where stored as raw blocks

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape if self.blocks is None else (*self.shape[:-1], self.blocks[1])

    @property
    def stored_bytes(self) -> int:
        return int(np.prod(self.stored_shape, dtype=np.int64)) * (1 if self.blocks else 4)


def build_config(arch: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                 rope_freqs: np.ndarray | None = None,
                 rope_factors: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """config.json for a file; rope_freqs: the values of its rope_freqs tensor, where it has one;
    rope_factors: the values of its ROPE_FACTOR_TENSORS (Phi-3's LongRoPE), by tensor name."""
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        if required and f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{key}")
        return meta.get(f"{arch}.{key}", default)

    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hf_arch = "mixtral" if arch == "llama" and get("expert_count") else arch  # llama.cpp writes Mixtral as llama
    # The embedding matrix is the ground truth for the vocabulary size (the metadata
    # key is optional and the tokenizer list may be shorter than the padded matrix).
    vocab_size = shapes["token_embd.weight"][0]
    hidden = int(get("embedding_length", required=True))
    n_layers = int(get("block_count", required=True))
    n_heads = int(get("attention.head_count", required=True))
    ctx = int(get("context_length", 2048))
    common: dict[str, Any] = {
        "architectures": [_HF_CLASSES[hf_arch]], "model_type": _HF_MODEL_TYPES.get(hf_arch, hf_arch),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }  # fmt: skip
    if arch == "gpt2":
        return common | {
            "n_embd": hidden, "n_layer": n_layers, "n_head": n_heads, "n_positions": ctx, "n_ctx": ctx,
            "n_inner": int(get("feed_forward_length", 4 * hidden)),
            "layer_norm_epsilon": _f32(get("attention.layer_norm_epsilon", 1e-5)),
        }  # fmt: skip

    n_kv = get("attention.head_count_kv", n_heads)
    n_ff = get("feed_forward_length", 0, required=arch != "qwen35moe")  # Qwen3.5-MoE has no dense MLP
    if isinstance(n_kv, list) and arch != "gemma4":  # Gemma 4's per-layer lists: gguf_gemma.py
        raise ValueError("per-layer attention.head_count_kv is not supported")
    config = common | {
        "hidden_size": hidden, "intermediate_size": int(n_ff[0] if isinstance(n_ff, list) else n_ff),
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv[0] if isinstance(n_kv, list) else n_kv),
        # key_length is only written when head_dim != hidden / heads (e.g. Qwen3).
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": ctx, "hidden_act": "silu",
    }  # fmt: skip
    if arch in ("llama", "mistral"):
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    elif arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    elif arch == "phi3":
        config.update(_phi3_fields(get, config, rope_factors or {}))
    if arch == "gpt-oss":
        config.update(_gpt_oss_fields(get))
    elif get("expert_count") and arch not in DEEPSEEK_ARCHITECTURES:
        config.update(_moe_fields(arch, get, shapes, n_layers))
    # qwen2 always has q/k/v biases in HF; nothing to set. smollm3's NoPE layers are every 4th, as
    # llama.cpp hardcodes them and as transformers derives them when config.json does not list them.
    if arch != "phi3" and (rope_scaling := _rope_scaling(get)) is not None:
        config["rope_scaling"] = rope_scaling
        if arch == "gpt-oss":  # gpt-oss's YaRN, as its config.json has it: the correction range untruncated
            config["rope_scaling"].update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    if arch in DEEPSEEK_ARCHITECTURES:
        return deepseek_config(get, config, shapes, config.get("rope_scaling"))
    if arch in GEMMA_ARCHITECTURES:
        def get_float(key: str) -> float | None:
            return None if (value := get(key)) is None else _f32(value)

        return gemma_config(arch, get, get_float, config, shapes, rope_freqs)
    if arch in HYBRID_ARCHITECTURES:
        return hybrid_config(arch, get, config)
    if "rope_freqs.weight" in shapes:
        logger.warning("dropping rope_freqs.weight (llama3-style rope factors are not reconstructed)")
    return config


def _phi3_fields(get: Callable[..., Any], config: dict[str, Any], rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """What convert_hf_to_gguf's Phi3MiniModel writes elsewhere: the rotating share of a head as
    rope.dimension_count, LongRoPE's original context and factors (as tensors), no window as 0."""
    fields: dict[str, Any] = {"rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
                              "sliding_window": int(get("attention.sliding_window", 0)) or None}
    rotary_dims = int(get("rope.dimension_count", config["head_dim"]))
    if rotary_dims != config["head_dim"]:
        fields["partial_rotary_factor"] = rotary_dims / config["head_dim"]
    if (original := get("rope.scaling.original_context_length")) is not None:
        fields["original_max_position_embeddings"] = int(original)
    if all(name in rope_factors for name in ROPE_FACTOR_TENSORS):
        fields["rope_scaling"] = {"rope_type": "longrope", "type": "longrope",
                                  "long_factor": rope_factors["rope_factors_long.weight"],
                                  "short_factor": rope_factors["rope_factors_short.weight"]}
    return fields


def _moe_fields(arch: str, get: Callable[..., Any], shapes: dict[str, tuple[int, ...]],
                n_layers: int) -> dict[str, Any]:
    """What llama.cpp's graphs fix per architecture: Qwen3-MoE and Mixtral renormalise the top-k
    weights, Qwen2-MoE and OLMoE do not; a layer without a router (ffn_gate_inp) is dense."""
    fields: dict[str, Any] = {"num_experts": int(get("expert_count")),
                              "num_experts_per_tok": int(get("expert_used_count", required=True)),
                              "norm_topk_prob": arch in ("qwen3moe", "llama"),
                              "attention_bias": "blk.0.attn_q.bias" in shapes}
    if arch in ("qwen2moe", "qwen3moe", "qwen3next", "qwen35moe"):
        fields["moe_intermediate_size"] = int(get("expert_feed_forward_length", required=True))
        fields["mlp_only_layers"] = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    if arch == "qwen2moe":
        fields["qkv_bias"] = fields.pop("attention_bias")
    if arch in ("qwen2moe", "qwen3next", "qwen35moe"):
        fields["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    if arch == "olmoe" and (clip := get("attention.clamp_kqv")) is not None:
        fields["clip_qkv"] = _f32(clip)
    return fields


def _gpt_oss_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """What llama.cpp's gpt-oss graph fixes: biases everywhere, sliding layers alternating from the
    first, the clamped SwiGLU's alpha 1.702 and limit 7.0 (transformers' defaults, left unset)."""
    return {"num_local_experts": int(get("expert_count", required=True)),
            "num_experts_per_tok": int(get("expert_used_count", required=True)),
            "intermediate_size": int(get("expert_feed_forward_length", required=True)),
            "sliding_window": int(get("attention.sliding_window", required=True)), "attention_bias": True}


def _f32(value: Any) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest
    # float32 repr recovers the value that was written, which keeps config.json tidy.
    return float(str(np.float32(value)))


def _rope_scaling(get: Callable[[str, Any], Any]) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None)
    if kind in (None, "none") or factor is None:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": _f32(factor)}
    if (orig := get("rope.scaling.original_context_length", None)) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _as_one_row(w: np.ndarray) -> np.ndarray:
    return w.reshape(1, -1)


def _unpermute_rotary(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """Undo convert_hf_to_gguf's q/k permutation for llama-family models.

    HF llama rotates each head as two halves (x[:d/2], x[d/2:]); ggml's "normal" rope
    rotates adjacent pairs (x[2i], x[2i+1]). llama.cpp's converter therefore reorders
    the output rows of q_proj/k_proj (weights and biases) within each head, taking
    row layout (2, d/2) to (d/2, 2). Here the inverse: (d/2, 2) -> (2, d/2).
    """

    def fn(w: np.ndarray) -> np.ndarray:
        half = w.shape[0] // n_head // 2
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return fn


def plan_tensors(arch: str, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[TensorPlan]:
    is_gpt2 = arch == "gpt2"
    is_gemma, is_hybrid = arch in GEMMA_ARCHITECTURES, arch in HYBRID_ARCHITECTURES
    if is_gpt2:
        block_names, global_names = _GPT2_BLOCK_NAMES, _GPT2_GLOBAL_NAMES
    elif is_gemma:
        block_names = gemma_block_names(arch, _LLAMA_BLOCK_NAMES)
        global_names = gemma_global_names(arch, _LLAMA_GLOBAL_NAMES)
    elif arch in DEEPSEEK_ARCHITECTURES:
        block_names, global_names = DEEPSEEK_BLOCK_NAMES, _LLAMA_GLOBAL_NAMES
    else:
        block_names = {"phi3": _PHI3_BLOCK_NAMES, "gpt-oss": _GPT_OSS_BLOCK_NAMES}.get(
            arch, _LLAMA_BLOCK_NAMES | _MOE_BLOCK_NAMES)
        block_names = hybrid_block_names(block_names) if is_hybrid else block_names
        global_names = _LLAMA_GLOBAL_NAMES
    block_prefix = "transformer.h" if is_gpt2 else "model.layers"
    # Only the llama family is stored permuted (SmolLM3 converts as llama does): qwen2/qwen3 and
    # phi3 use NEOX-style rope in llama.cpp, which matches HF's half-split layout as is.
    permuted = arch in ("llama", "mistral", "smollm3")

    plans: list[TensorPlan] = []
    for name, shape in shapes.items():
        if name in _SKIPPED_TENSORS:
            continue
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        on_columns = False
        if m := _BLOCK_RE.match(name):
            layer, kind, suffix = m.groups(default="")
            if is_hybrid and int(layer) >= config["num_hidden_layers"]:
                continue  # a multi-token-prediction block
            if is_hybrid and (parameter := hybrid_parameter_name(kind, suffix)) is not None:
                hf = f"{block_prefix}.{layer}.{parameter}"
            elif kind not in block_names or not suffix:
                raise ValueError(f"unexpected tensor {name!r} for architecture {arch!r}")
            else:
                hf = f"{block_prefix}.{layer}.{block_names[kind]}" + ("" if kind == "attn_sinks" else f".{suffix}")
            if is_hybrid:
                transform, shape, on_columns = hybrid_transform(arch, kind, config, shape)
            elif permuted and kind == "attn_q":
                transform = _unpermute_rotary(config["num_attention_heads"])
            elif permuted and kind == "attn_k":
                transform = _unpermute_rotary(config["num_key_value_heads"])
            elif is_gpt2 and kind in _GPT2_CONV1D and suffix == "weight":
                transform, shape, on_columns = np.transpose, shape[::-1], True
            elif kind == "ffn_gate_inp_shexp":  # HF's [1, hidden], which llama.cpp may store as [hidden]
                shape, transform = (1, shape[-1]), _as_one_row
            elif arch in DEEPSEEK_ARCHITECTURES:
                shape, transform, on_columns = deepseek_transform(kind, shape)
                hf = deepseek_hf_name(hf)
        elif (m := _GLOBAL_RE.match(name)) and m.group(1) in global_names:
            hf = f"{global_names[m.group(1)]}.{m.group(2)}"
            if is_hybrid:
                transform, shape, on_columns = hybrid_transform(arch, m.group(1), config, shape)
        else:
            raise ValueError(f"unexpected tensor {name!r} for architecture {arch!r}")
        if is_gemma:
            hf, transform = gemma_hf_name(hf), gemma_norm_transform(arch, hf) or transform
        plans.append(TensorPlan(name, hf, shape, transform, on_columns))
    return plans
