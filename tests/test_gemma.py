"""Gemma beyond what every ARCHS-parametrized test checks: multimodal checkpoints' text models, GGUF
round trips through the `gguf` writer, refusals, and `roseinfer serve` with a Gemma chat template."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch, save_file

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.layers.rotary import rope_parameters
from roseinfer.loader.gguf import convert_gguf
from roseinfer.models.config import ModelConfig
from roseinfer.server.app import build_app
from roseinfer.server.tool_calls import takes_system_role
from gguf_writer import gguf_tensor_names, make_tiny_tokenizer, write_tiny_gguf
from server_helpers import model_copy, openai_client, serve_app
from tiny_models import SLIDING_WINDOW, hf_greedy, sample_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Gemma 2 instruct's turn markup, which is not ChatML and refuses a system role
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def _greedy_matches_hf(engine_dir: Path, reference_dir: Path, **options) -> None:
    prompts = sample_prompts(reference_dir, 3, seed=5)
    llm = LLM(model=str(engine_dir), num_kv_blocks=64, **options)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference_dir, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    assert llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_conditional_generation_checkpoint_runs_its_text_model(tiny_model_factory, tmp_path: Path,
                                                               prefix: str) -> None:
    """A Gemma3ForConditionalGeneration folder (transformers 5's names, and the older ones): the
    text model's config from text_config, its weights renamed, the vision tower's left unread."""
    text_dir = tiny_model_factory("gemma3")
    out = tmp_path / "gemma3_mm"
    shutil.copytree(text_dir, out)
    text_config = json.loads((text_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "tie_word_embeddings": text_config.pop("tie_word_embeddings"), "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}}))
    weights = {prefix + name.removeprefix("model."): tensor
               for name, tensor in load_torch(str(text_dir / "model.safetensors")).items()}
    weights["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(8, 3, 2, 2)
    weights["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(8, 64)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert ModelConfig.from_dict(json.loads((out / "config.json").read_text())).model_type == "gemma3_text"
    _greedy_matches_hf(out, text_dir)


def test_unsupported_gemma_variants_are_refused_with_the_reason() -> None:
    base = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128}
    with pytest.raises(ValueError, match="mixture-of-experts.*enable_moe_block"):
        ModelConfig.from_dict({"model_type": "gemma4_text", **base, "enable_moe_block": True})
    with pytest.raises(ValueError, match="use_bidirectional_attention.*not a causal LM"):
        ModelConfig.from_dict({"model_type": "gemma3_text", **base, "use_bidirectional_attention": True})


def _tiny_gemma(model_type: str, vocab_size: int) -> torch.nn.Module:
    """What llama.cpp can represent: its fixed layer pattern (Gemma 3: 5 local, 1 global), local
    rope base and query scale (head_dim); a window, soft-caps and global rope scaling that bite.
    Gemma 4's norms scale by w (not 1 + w): they are drawn around 1."""
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=128,
                  sliding_window=SLIDING_WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if model_type == "gemma2":
        cfg = transformers.Gemma2Config(**common, num_hidden_layers=2, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=12.0)
    elif model_type == "gemma4_text":  # as tiny_models' gemma4: every Gemma 4 feature but mixture-of-experts
        cfg = transformers.Gemma4TextConfig(
            **common, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=1,
            use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
            final_logit_softcapping=5.0, tie_word_embeddings=False)
    else:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}}
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=6, rope_parameters=rope,
                                            tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.3) + (p.ndim == 1 and model_type == "gemma4_text"))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1.0 + torch.randn_like(buffer) * 0.2)
    return model.eval()


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gemma4_text"])
def test_gguf_roundtrip_and_engine_match_hf(tmp_path: Path, model_type: str) -> None:
    tok = make_tiny_tokenizer(300)
    model = _tiny_gemma(model_type, len(tok))
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, tok, "F32")
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))

    # every tensor comes back under its HF name: norms as (1 + w) - 1, which (1 + w) recomputes exactly
    saved, state = load_file(str(folder / "model.safetensors")), model.state_dict()
    assert set(saved) == set(gguf_tensor_names(model))
    for name, tensor in saved.items():
        ref = state[name].numpy()
        if name.endswith("norm.weight") and model_type != "gemma4_text":
            np.testing.assert_array_equal(tensor + np.float32(1.0), ref + np.float32(1.0), err_msg=name)
        else:
            np.testing.assert_array_equal(tensor, ref, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type and config["sliding_window"] == SLIDING_WINDOW
    assert config["layer_types"] == model.config.layer_types
    engine_config, original = ModelConfig.from_dict(config), ModelConfig.from_dict(model.config.to_dict())
    assert replace(engine_config, raw_config={}) == replace(original, raw_config={})
    for kind in ("sliding_attention", "full_attention"):  # the rope (Gemma 2: one for both)
        assert rope_parameters(engine_config.raw_config, kind) == rope_parameters(original.raw_config, kind)

    # transformers on the converted folder and the engine on the file both match the original
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(0, len(tok), (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    original = tmp_path / "original"
    model.save_pretrained(str(original))
    tok.save_pretrained(str(original))
    _greedy_matches_hf(src, original)


def test_serve_gemma_with_its_chat_template(tiny_model_factory, tmp_path: Path) -> None:
    """The OpenAI client against `roseinfer serve`'s app: the folder's (non-ChatML) template renders
    the prompt, and the reply is HF's greedy continuation of it; tools (their prompt in the first
    user message, the template refusing a system one) and structured output work."""
    # room for the tools prompt; the template in tokenizer_config.json, as Gemma 3 ships it
    folder = model_copy(tiny_model_factory("gemma3"), tmp_path / "gemma3_chat", max_position_embeddings=1024,
                        chat_template=GEMMA_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (f"{tokenizer.bos_token}<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    expected = tokenizer.decode(hf_greedy(folder, prompt_ids, MAX_TOKENS), skip_special_tokens=True)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64))
    assert not takes_system_role(engine.tokenizer)
    with serve_app(build_app(engine, "gemma")) as url:
        client = openai_client(url)
        reply = client.chat.completions.create(
            model="gemma", messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        # a random model's tool call and JSON: the constraints alone make them valid
        call = client.chat.completions.create(model="gemma", messages=messages, tools=tools, tool_choice="required",
                                              temperature=0, max_tokens=256).choices[0]
        structured = client.chat.completions.create(
            model="gemma", messages=messages, temperature=0, max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": params}})
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == expected
    assert call.finish_reason == "tool_calls" and call.message.tool_calls[0].function.name == "get_weather"
    assert set(json.loads(call.message.tool_calls[0].function.arguments)) == {"city"}
    assert set(json.loads(structured.choices[0].message.content)) == {"city"}
