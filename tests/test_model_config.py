"""ModelConfig reads config.json itself; every field must equal what transformers' config gives."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from transformers import AutoConfig

from roseinfer.loader.model_loader import load_model_config
from roseinfer.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from tiny_models import ARCHS, EXTRA_ARCHS


def _expected(hf) -> dict:
    """The engine's fields, read the way transformers' config objects expose them."""
    if hf.model_type == "gpt2":
        return {"hidden_size": hf.n_embd, "num_layers": hf.n_layer, "num_heads": hf.n_head,
                "intermediate_size": hf.n_inner or 4 * hf.n_embd, "max_position_embeddings": hf.n_positions,
                "norm_eps": hf.layer_norm_epsilon, "hidden_act": hf.activation_function}
    return {"hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers, "num_heads": hf.num_attention_heads,
            "num_kv_heads": hf.num_key_value_heads, "intermediate_size": hf.intermediate_size,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            "max_position_embeddings": hf.max_position_embeddings, "norm_eps": hf.rms_norm_eps, "hidden_act": hf.hidden_act,
            "tie_word_embeddings": hf.tie_word_embeddings}


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
    raw = {"model_type": model_type, **MINIMAL["gpt2" if model_type == "gpt2" else "llama"]}
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    _assert_matches(ModelConfig.from_dict(raw), AutoConfig.for_model(model_type, **fields))


def test_missing_required_field_is_a_clear_error() -> None:
    raw = {"model_type": "llama", **MINIMAL["llama"]}
    del raw["intermediate_size"]
    with pytest.raises(ValueError, match="config.json has no 'intermediate_size'"):
        ModelConfig.from_dict(raw)


def test_default_rope_model_loads_without_transformers(tiny_model_factory) -> None:
    """Scaled rope borrows transformers' formulas; a default-rope model must not import it at all."""
    folder: pathlib.Path = tiny_model_factory("llama")
    assert json.loads((folder / "config.json").read_text()).get("rope_scaling") is None
    code = ("import sys, torch; from roseinfer.loader.model_loader import load_model, load_model_config; "
            "from roseinfer.backends import select_backend; "
            f"p = {str(folder)!r}; from pathlib import Path; cfg = load_model_config(Path(p)); cpu = torch.device('cpu'); "
            "load_model(Path(p), cfg, torch.float32, cpu, select_backend('auto', cpu, torch.float32, cfg)); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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
