"""Checks of the test fixtures themselves: if these fail, every engine-vs-HF test is suspect."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open

from tiny_models import (ARCHS, CHAT_TEMPLATE, SHARDED_ARCHS, SLIDING_WINDOW, build_tiny_model, hf_greedy,
                         hf_greedy_generate, load_hf_model, sample_prompts)


def _weights(model_dir: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """name -> shape over all safetensors files in the folder (sharded or not)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def test_checkpoint_folder_complete(tiny_model_dir: pathlib.Path) -> None:
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (tiny_model_dir / name).is_file(), name
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tok = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    n_tok = len(tok["model"]["vocab"])
    assert cfg["vocab_size"] == n_tok == 384
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    w = _weights(tiny_model_dir)
    assert w and all(len(s) >= 1 for s in w.values())


def test_arch_specific_layout(tiny_model_factory) -> None:
    """Each arch exercises the loader feature it is in ARCHS for."""
    def load(arch: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
        d = tiny_model_factory(arch)
        return json.loads((d / "config.json").read_text()), _weights(d)

    cfg, w = load("gpt2")
    assert cfg["model_type"] == "gpt2" and "lm_head.weight" not in w
    assert w["transformer.h.0.attn.c_attn.weight"] == (64, 192)  # Conv1D: [in, out], fused qkv

    cfg, w = load("llama")
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in w
    assert w["model.layers.0.self_attn.k_proj.weight"] == (32, 64)  # 2 kv heads x 16

    cfg, w = load("llama3_rope_untied")
    assert cfg["rope_parameters"]["rope_type"] == "llama3"  # transformers 5: rope_scaling -> rope_parameters
    assert cfg["tie_word_embeddings"] is False and w["lm_head.weight"] == (384, 64)

    cfg, w = load("mistral")
    assert cfg["model_type"] == "mistral" and cfg.get("sliding_window") is None

    cfg, w = load("qwen2")
    assert w["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert w["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000.0

    cfg, w = load("qwen3")
    assert cfg["head_dim"] == 32 and cfg["hidden_size"] // cfg["num_attention_heads"] == 16
    assert w["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert w["model.layers.0.self_attn.q_norm.weight"] == (32,)

    cfg, w = load("llama_mqa")
    assert cfg["num_key_value_heads"] == 1 and w["model.layers.0.self_attn.v_proj.weight"] == (16, 64)

    cfg, w = load("mistral_sliding")
    assert cfg["sliding_window"] == SLIDING_WINDOW

    cfg, w = load("qwen2_sliding")
    assert cfg["use_sliding_window"] and cfg["sliding_window"] == SLIDING_WINDOW
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"]

    cfg, w = load("phi3_longrope")  # q/k/v and gate/up fused in the checkpoint
    assert w["model.layers.0.self_attn.qkv_proj.weight"] == (128, 64)
    assert w["model.layers.0.mlp.gate_up_proj.weight"] == (256, 64)
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert rope["original_max_position_embeddings"] == 48 < 100  # the longest test prompt crosses it
    assert cfg.get("sliding_window") is None

    cfg, w = load("smollm3_yarn")
    assert cfg["no_rope_layers"] == [1, 0] and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"]  # its NoPE layer slides


def test_sharded_index(tiny_model_factory) -> None:
    assert "mistral" in SHARDED_ARCHS
    d = tiny_model_factory("mistral")
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2
    assert all((d / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(_weights(d))


def test_build_is_deterministic(tiny_model_factory, tmp_path: pathlib.Path) -> None:
    a = tiny_model_factory("qwen3")
    b = build_tiny_model("qwen3", tmp_path / "again")
    with safe_open(str(a / "model.safetensors"), "pt") as sa, safe_open(str(b / "model.safetensors"), "pt") as sb:
        assert set(sa.keys()) == set(sb.keys())
        for k in sa.keys():
            assert torch.equal(sa.get_tensor(k), sb.get_tensor(k)), k


def _long_rope_switch(model: torch.nn.Module) -> float:
    """The sequence length past which HF rotates with LongRoPE's long factors (inf without them)."""
    rope = getattr(model.config, "rope_parameters", None) or {}
    return rope["original_max_position_embeddings"] if rope.get("rope_type") == "longrope" else float("inf")


def test_reference_not_degenerate(tiny_model_dir: pathlib.Path, hf_reference) -> None:
    """HF greedy = plain argmax, 30 tokens long, varied, and far from ties.

    The top-2 gap matters: an fp32 engine differs from HF by ~1e-5 in the logits, so a
    near-tie would make token-for-token comparisons flaky rather than meaningful.
    """
    model = load_hf_model(tiny_model_dir)
    gaps = []
    for prompt in sample_prompts(tiny_model_dir, 4, seed=7):
        new = hf_reference(tiny_model_dir, prompt, 30)
        assert len(new) == 30 and all(0 <= t < 384 for t in new)
        assert len(set(new)) >= 8, f"degenerate continuation {new}"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1]
        # no EOS masking / processors in the reference; except where LongRoPE switches factors inside
        # the continuation: generate rotates the tokens before the switch short, one forward all long
        if not len(prompt) <= _long_rope_switch(model) < len(prompt) + 30:
            assert logits.argmax(-1).tolist() == new
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    gaps_t = torch.cat(gaps)
    assert gaps_t.median() > 0.05
    assert (gaps_t < 1e-3).float().mean() < 0.05


def test_reference_is_cached_and_repeatable(tiny_model_factory) -> None:
    d = tiny_model_factory("llama")
    assert load_hf_model(d) is load_hf_model(str(d))
    prompt = sample_prompts(d, 1, seed=3)[0]
    assert hf_greedy(d, prompt, 12) == hf_greedy_generate(d, prompt, 12) == hf_greedy_generate(d, prompt, 12)
    # Greedy is prefix-consistent: a shorter run is a prefix of a longer one.
    assert hf_greedy_generate(d, prompt, 5) == hf_greedy(d, prompt, 12)[:5]


@pytest.mark.parametrize("arch,override", [
    ("llama3_rope_untied", {"rope_type": "default", "rope_theta": 500000.0}),
    ("qwen2", {"rope_type": "default", "rope_theta": 10000.0}),
])
def test_rope_settings_matter(tiny_model_factory, arch: str, override: dict) -> None:
    """An engine that ignored llama3 rope scaling or rope_theta must visibly fail."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tiny_model_factory(arch)
    prompt = sample_prompts(d, 2, seed=11)[1]  # the 100-token one: positions past 64 matter
    ref = hf_greedy(d, prompt, 20)
    cfg = AutoConfig.from_pretrained(d)
    cfg.rope_parameters = override
    wrong = AutoModelForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    wrong.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = wrong.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                         pad_token_id=2)[0, len(prompt):].tolist()
    assert out != ref


def test_tokenizer_round_trip_and_chat_template(tokenizer_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 384
    assert (tok.convert_tokens_to_ids("<|endoftext|>"), tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in ["Hello, world!", "The cat sees a red apple slowly.", "  two  spaces\n\ttab",
                 "Café naïve 🍕 日本語", "def add(a, b):\n    return a + b\n", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert len(tok.encode("The cat sees a red apple.")) < len("The cat sees a red apple.")  # merges learned
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single ids, not split into bytes


def test_sample_prompts(tokenizer_dir: pathlib.Path) -> None:
    prompts = sample_prompts(tokenizer_dir, 8, seed=0)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 8 and lengths[0] == 1 and lengths[-1] == 100
    assert len(set(lengths)) >= 6
    assert all(0 <= t < 384 for p in prompts for t in p)
    assert sample_prompts(tokenizer_dir, 8, seed=0) == prompts
    assert sample_prompts(tokenizer_dir, 8, seed=1) != prompts


@pytest.mark.cuda
def test_cuda_marker() -> None:
    """Skipped (reason "needs CUDA") on CPU-only machines by the conftest hook."""
    assert torch.cuda.is_available()


def test_archs_list() -> None:
    assert ARCHS == ["gpt2", "llama", "llama3_rope_untied", "mistral", "qwen2", "qwen3", "llama_mqa",
                     "qwen2_sliding", "phi3_longrope", "smollm3_yarn", "gemma2", "gemma3", "gemma4"]
