"""ModelConfig reads config.json itself; every field must equal what transformers' config gives."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from transformers import AutoConfig

from roseinfer.layers.rope_parameters import rope_parameters, rotary_dim
from roseinfer.loader.model_loader import load_model_config
from roseinfer.models.config import MOE_FAMILY, MULTIMODAL_WRAPPERS, SUPPORTED_MODEL_TYPES, ModelConfig
from roseinfer.models.hybrid_config import HYBRID_FAMILY, HYBRID_MOE_FAMILY
from tiny_models import ARCHS, EXTRA_ARCHS


def _expected(hf) -> dict:
    """The engine's fields, read the way transformers' config objects expose them."""
    if hf.model_type == "gemma4_text":  # head_dim / num_kv_heads vary by layer: _assert_gemma checks them
        hf.allow_global_per_layer_attribute_access = True
    if hf.model_type == "gpt2":
        return {"hidden_size": hf.n_embd, "num_layers": hf.n_layer, "num_heads": hf.n_head,
                "intermediate_size": hf.n_inner or 4 * hf.n_embd, "max_position_embeddings": hf.n_positions,
                "norm_eps": hf.layer_norm_epsilon, "hidden_act": hf.activation_function}
    expected = {"hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers,
                "num_heads": hf.num_attention_heads, "num_kv_heads": hf.num_key_value_heads,
                "intermediate_size": getattr(hf, "intermediate_size", 0),  # Qwen3.5-MoE has no dense MLP
                "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                "max_position_embeddings": hf.max_position_embeddings, "norm_eps": hf.rms_norm_eps,
                "hidden_act": getattr(hf, "hidden_activation", None) or hf.hidden_act,
                "tie_word_embeddings": hf.tie_word_embeddings}
    if hf.model_type.startswith("gemma"):
        expected |= {"layer_types": tuple(hf.layer_types), "final_logit_softcap": hf.final_logit_softcapping,
                     "attn_logit_softcap": getattr(hf, "attn_logit_softcapping", None) if hf.model_type == "gemma2"
                     else None}
    if hf.model_type == "gemma4_text":  # head_dim / num_kv_heads are the KV pool's row; each layer's own:
        del expected["head_dim"], expected["num_kv_heads"]
    if hf.model_type.startswith("deepseek"):  # the pool's row is MLA's latent + rope key (_assert_deepseek)
        expected |= {"head_dim": hf.kv_lora_rank + hf.qk_rope_head_dim, "num_kv_heads": 1}
    return expected


def _assert_deepseek(cfg: ModelConfig, hf) -> None:
    """MLA's shapes and the routing, field by field as transformers' modeling files read them."""
    mla, moe = cfg.mla, cfg.deepseek_moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    assert mla.rope_in_halves == (hf.model_type == "deepseek_v3" and not hf.rope_interleave)
    v3 = hf.model_type == "deepseek_v3"
    grouped = v3 or hf.topk_method == "group_limited_greedy"
    routing = moe.routing
    assert (routing.num_experts, routing.top_k, routing.scaling_factor) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.routed_scaling_factor)
    assert (routing.num_groups, routing.top_groups) == ((hf.n_group, hf.topk_group) if grouped else (1, 1))
    assert routing.normalise == (v3 and hf.norm_topk_prob)
    assert (moe.expert_size, moe.shared_size, moe.first_moe_layer) == (
        hf.moe_intermediate_size, hf.moe_intermediate_size * hf.n_shared_experts, hf.first_k_dense_replace)


def _assert_gemma(cfg: ModelConfig, hf) -> None:
    """Gemma's rope per layer type, attention scale and (Gemma 4) per-layer head shapes."""
    for kind in set(hf.layer_types):
        assert cfg.raw_config["rope_parameters"][kind] == hf.rope_parameters[kind] if \
            hf.model_type != "gemma2" else cfg.raw_config["rope_parameters"][kind]["rope_theta"] == \
            hf.rope_parameters["rope_theta"]
    if hf.model_type != "gemma4_text":
        assert cfg.attn_scale == hf.query_pre_attn_scalar ** -0.5
        return
    assert cfg.attn_scale == 1.0
    shapes = [(hf.per_layer_config[i].num_key_value_heads, hf.per_layer_config[i].head_dim)
              for i in range(hf.num_hidden_layers)]
    assert list(cfg.gemma4.head_shapes) == shapes
    assert cfg.gemma4.kv_shared_layers == hf.num_kv_shared_layers and cfg.gemma4.k_eq_v == hf.attention_k_eq_v
    assert cfg.gemma4.per_layer_input_size == hf.hidden_size_per_layer_input
    assert cfg.gemma4.per_layer_vocab_size == hf.vocab_size_per_layer_input


def _assert_hybrid(cfg: ModelConfig, hf) -> None:
    """Qwen3.5, Qwen3-Next, Qwen3.5-MoE: which layers are linear, their shape, and the full layers'
    partial rotary."""
    assert cfg.layer_types == tuple(hf.layer_types)
    shape = cfg.linear_attention
    assert (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim, shape.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    params = rope_parameters(cfg.raw_config)
    assert params["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert rotary_dim(cfg.head_dim, cfg.raw_config) == int(cfg.head_dim * hf.rope_parameters["partial_rotary_factor"])


def _expected_windows(hf) -> list[int | None]:
    """Each layer's sliding window as transformers' modeling files apply it: to every layer where
    the config has no `layer_types` (Mistral), else to its sliding ones."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _assert_matches(cfg: ModelConfig, hf) -> None:
    assert cfg.vocab_size == hf.vocab_size
    for key, value in _expected(hf).items():
        assert getattr(cfg, key) == value, key
    if hf.model_type != "gpt2":
        assert [cfg.layer_sliding_window(i) for i in range(cfg.num_layers)] == _expected_windows(hf)
    if hf.model_type.startswith("gemma"):
        _assert_gemma(cfg, hf)
    if hf.model_type.startswith("deepseek"):
        _assert_deepseek(cfg, hf)
    if hf.model_type in HYBRID_FAMILY:
        _assert_hybrid(cfg, hf)
    if hf.model_type in MOE_FAMILY + HYBRID_MOE_FAMILY:
        _assert_moe(cfg, hf)


def _assert_moe(cfg: ModelConfig, hf) -> None:
    """Experts, top-k, widths and renormalisation as transformers' MoE modules read them (Mixtral
    always renormalises; which layers are sparse: tests/test_moe.py, against the built model)."""
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k) == (hf.num_experts, hf.num_experts_per_tok)
    assert moe.expert_width == (getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
    assert moe.norm_topk_prob == getattr(hf, "norm_topk_prob", True)  # Qwen3.5-MoE: always renormalised
    assert moe.shared_expert_width == getattr(hf, "shared_expert_intermediate_size", 0)
    assert cfg.clip_qkv == getattr(hf, "clip_qkv", None)


@pytest.mark.parametrize("arch", ARCHS + EXTRA_ARCHS)
def test_checkpoint_configs_match_transformers(tiny_model_factory, arch: str) -> None:
    folder = tiny_model_factory(arch)
    _assert_matches(load_model_config(folder), AutoConfig.from_pretrained(folder))


MINIMAL = {
    "gpt2": {"vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4},
    "llama": {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128},
}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_missing_fields_take_transformers_defaults(model_type: str) -> None:
    fields = dict(MINIMAL["gpt2" if model_type == "gpt2" else "llama"])
    if model_type in MULTIMODAL_WRAPPERS:  # the text model's fields, as Gemma3ForConditionalGeneration has them
        fields = {"text_config": {"model_type": MULTIMODAL_WRAPPERS[model_type], **fields}}
    hf = AutoConfig.for_model(model_type, **fields)
    _assert_matches(ModelConfig.from_dict({"model_type": model_type, **fields}), getattr(hf, "text_config", hf))


def test_missing_required_field_is_a_clear_error() -> None:
    raw = {"model_type": "llama", **MINIMAL["llama"]}
    del raw["intermediate_size"]
    with pytest.raises(ValueError, match="config.json has no 'intermediate_size'"):
        ModelConfig.from_dict(raw)


def test_default_rope_model_loads_without_transformers(tiny_model_factory) -> None:
    """Scaled rope borrows transformers' formulas; a default-rope model must not import it at all."""
    folder: pathlib.Path = tiny_model_factory("llama")
    assert json.loads((folder / "config.json").read_text()).get("rope_scaling") is None
    code = ("import sys, torch; from roseinfer.loader.model_loader import load_model_config; "
            "from roseinfer.worker.worker import load_prepared_model; "
            "from roseinfer.backends import select_backend; "
            f"p = {str(folder)!r}; from pathlib import Path; cfg = load_model_config(Path(p)); cpu = torch.device('cpu'); "
            "load_prepared_model(Path(p), cfg, torch.float32, cpu, select_backend('auto', cpu, torch.float32, cfg)); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# config.json as Google's checkpoints ship it (transformers 4 field names): Gemma 3 1B and the text
# model of Gemma 3 4B, whose wrapper leaves most fields to the defaults
GEMMA3_1B = {"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
             "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000,
             "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
             "vocab_size": 262144, "final_logit_softcapping": None, "attn_logit_softcapping": None}
GEMMA3_4B = {"model_type": "gemma3", "text_config": {
    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}


@pytest.mark.parametrize("raw", [GEMMA3_1B, GEMMA3_4B], ids=["gemma3_1b", "gemma3_4b"])
def test_released_gemma_configs_match_transformers(raw: dict) -> None:
    hf = AutoConfig.for_model(**raw)
    _assert_matches(ModelConfig.from_dict(raw), getattr(hf, "text_config", hf))


@pytest.mark.parametrize("layers", [{"no_rope_layers": [1, 0, 1, 0, 0]}, {"no_rope_layer_interval": 2}, {}])
def test_smollm3_nope_layers_are_transformers(layers: dict) -> None:
    """SmolLM3's NoPE layers: listed (1 = rotates), or every no_rope_layer_interval-th, 4 by default."""
    raw = {"model_type": "smollm3", **MINIMAL["llama"], "num_hidden_layers": 5, **layers}
    hf = AutoConfig.for_model("smollm3", **{k: v for k, v in raw.items() if k != "model_type"})
    cfg = ModelConfig.from_dict(raw)
    assert cfg.nope_layers == tuple(i for i, rotates in enumerate(hf.no_rope_layers) if not rotates)
    assert cfg.nope_layers  # every case has one


def test_long_rope_switch_only_where_the_context_reaches_past_the_original() -> None:
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    raw = {"model_type": "phi3", **MINIMAL["llama"], "max_position_embeddings": 4096,
           "original_max_position_embeddings": 1024, "rope_scaling": {"type": "longrope", **factors}}
    assert ModelConfig.from_dict(raw).long_rope_from == 1024
    assert ModelConfig.from_dict({**raw, "max_position_embeddings": 1024}).long_rope_from is None
    assert ModelConfig.from_dict({**raw, "rope_scaling": None}).long_rope_from is None
