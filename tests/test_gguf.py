"""GGUF -> HF folder conversion (roseinfer.loader.gguf) against tiny models written the
way llama.cpp writes them (tests/gguf_writer.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).parent))  # tests/ is not a package
from gguf_writer import gguf_tensor_names, llama_permute, make_tiny_tokenizer, write_tiny_gguf  # noqa: E402

import roseinfer.loader.gguf as gguf_loader  # noqa: E402
from roseinfer.loader.gguf import SUPPORTED_ARCHITECTURES, convert_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(300)


def _tiny_model(model_type: str, vocab_size: int, hidden: int = 64, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=hidden, n_layer=2, n_head=4, n_positions=64, n_inner=128,
            bos_token_id=1, eos_token_id=2, **overrides,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls_cfg = dict(llama=transformers.LlamaConfig, qwen2=transformers.Qwen2Config, qwen3=transformers.Qwen3Config,
                       phi3=transformers.Phi3Config, smollm3=transformers.SmolLM3Config)
        kwargs = dict(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )  # fmt: skip
        if model_type == "qwen3":
            kwargs.update(head_dim=32, tie_word_embeddings=True)  # head_dim != hidden/heads, like real Qwen3
        if model_type == "llama":
            kwargs.update(rope_theta=100000.0)
        if model_type == "phi3":  # half of each head rotates; the 12-token test input is past LongRoPE's 8
            kwargs.update(pad_token_id=None, partial_rotary_factor=0.5, original_max_position_embeddings=8, sliding_window=6,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                        "long_factor": [1.5, 3.0, 7.0, 13.0]})
        if model_type == "smollm3":  # 4 layers: the 4th has no rotary (llama.cpp's fixed NoPE interval)
            kwargs.update(pad_token_id=None, num_hidden_layers=4, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                             "original_max_position_embeddings": 32})
        cfg = cls_cfg[model_type](**(kwargs | overrides))
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    # Random init leaves norms at exactly 1 and biases at 0, which would hide a misnamed
    # or misplaced tensor: perturb every parameter.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gpt2", "phi3", "smollm3"])
def test_f32_roundtrip_exact_weights_and_logits(tmp_path: Path, tok, model_type: str) -> None:
    model = _tiny_model(model_type, len(tok))
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, tok, "F32")
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))

    # (a) every stored tensor equals the original weight exactly, under its HF name.
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    expected_names = set(gguf_tensor_names(model))
    assert set(saved) == expected_names
    for name in expected_names:
        ref = state["transformer.wte.weight" if name == "lm_head.weight" and model_type == "gpt2" else name]
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], ref.numpy(), err_msg=name)

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] == (model_type == "qwen3")
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    if model_type != "gpt2":
        assert config["rms_norm_eps"] == 1e-5  # float32 metadata read back as the value written
        assert config["head_dim"] == (32 if model_type == "qwen3" else 16)

    # (b) HF loads the folder and computes the same logits: a wrong q/k un-permutation,
    # transpose or rope parameter shows up here even where names and shapes are right.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-4, rtol=0)

    # The tokenizer comes back with the same ids, special tokens and chat template.
    loaded_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "What is the capital of France?<|im_end|> Paris, 42!"
    assert loaded_tok(text).input_ids == tok(text).input_ids
    assert loaded_tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert (loaded_tok.bos_token, loaded_tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = [{"role": "user", "content": "hi"}]
    assert loaded_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def _check_matches_dequantized(src: Path, folder: Path, model: torch.nn.Module) -> set[str]:
    """Each converted tensor == gguf.quants.dequantize(stored bytes), mapped back to HF
    layout; returns the GGML type names seen. Read with gguf-py's own reader, so this is
    independent of the loader's parser."""
    saved = load_file(str(folder / "model.safetensors"))
    cfg = model.config
    hf_by_gguf = {g: h for h, g in gguf_tensor_names(model).items()}
    seen: set[str] = set()
    for t in gguf.GGUFReader(src).tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got = saved[hf_by_gguf[t.name]]
        if ".attn_q." in t.name:  # compare in the file's (permuted) layout
            got = llama_permute(got, cfg.num_attention_heads)
        elif ".attn_k." in t.name:
            got = llama_permute(got, cfg.num_attention_heads, cfg.num_key_value_heads)
        np.testing.assert_array_equal(got, ref, err_msg=t.name)
        seen.add(t.tensor_type.name)
    return seen


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_equals_dequantize(tmp_path: Path, tok, qtype: str) -> None:
    model = _tiny_model("llama", len(tok))
    src = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", model, tok, qtype)
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))
    assert _check_matches_dequantized(src, folder, model) == {qtype, "F32"}  # norms stay F32
    if qtype in ("F16", "BF16", "Q8_0"):  # fine types: the model still behaves like the original
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.randint(0, len(tok), (1, 12), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=0.05, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_equal_dequantize_without_tokenizer(tmp_path: Path, qtype: str) -> None:
    # K-quant blocks hold 256 values, so rows must be 256 wide. gguf-py cannot quantize
    # K-quants; the writer stores random blocks, enough to check dequantization and layout.
    model = _tiny_model("llama", 300, hidden=256, intermediate_size=256, num_hidden_layers=1)
    src = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", model, None, qtype)
    folder = convert_gguf(src, cache_dir=str(tmp_path / "cache"))
    assert _check_matches_dequantized(src, folder, model) == {qtype, "F32"}
    assert not (folder / "tokenizer.json").exists()  # no tokenizer metadata -> no tokenizer files
    transformers.AutoModelForCausalLM.from_pretrained(folder)  # still a loadable folder


def test_cache_hit_does_not_convert_again_or_rewrite(tmp_path: Path, tok, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_model("llama", len(tok)), tok, "Q8_0")
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "env-cache"))
    folder = convert_gguf(src)
    assert folder.parent == tmp_path / "env-cache" / "gguf"
    weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp dir left behind

    def fail(*args: object) -> None:
        raise AssertionError("cache miss: converted again")

    monkeypatch.setattr(gguf_loader, "_convert_into", fail)
    again = convert_gguf(str(src))
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_mtime

    # A changed file (new mtime) is a different cache entry; cache_dir overrides the env.
    os.utime(src, ns=(weights_mtime, weights_mtime + 10**9))
    with pytest.raises(AssertionError, match="cache miss"):
        convert_gguf(src)
    monkeypatch.undo()
    monkeypatch.delenv("ROSEINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert convert_gguf(src).parent == tmp_path / "xdg" / "roseinfer" / "gguf"
    assert convert_gguf(src, cache_dir=str(tmp_path / "arg")).parent == tmp_path / "arg" / "gguf"


def test_conversion_prunes_folders_no_load_can_hit(tmp_path: Path, tok) -> None:
    cache = str(tmp_path / "cache")
    model = _tiny_model("llama", len(tok))
    gone = write_tiny_gguf(tmp_path / "gone.gguf", model, tok, "Q8_0")
    gone_folder = convert_gguf(gone, cache_dir=cache)
    gone.unlink()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, tok, "Q8_0")
    fp32, blocks = convert_gguf(src, cache_dir=cache), convert_gguf(src, cache_dir=cache, keep_blocks=True)
    assert not gone_folder.exists()  # its GGUF was deleted
    assert fp32.is_dir() and blocks.is_dir()  # one file's two forms are both current

    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file replaced in place
    fresh = convert_gguf(src, cache_dir=cache)
    assert sorted(p.name for p in fresh.parent.iterdir()) == [fresh.name]


def test_not_gguf_raises_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text('{"this is": "json, not gguf"}')
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(bad, cache_dir=str(tmp_path / "cache"))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(empty, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # rejected before anything is written


def test_truncated_gguf_raises_value_error(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_model("llama", 300), None, "F32")
    data = src.read_bytes()
    for cut in (64, len(data) // 2):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            convert_gguf(short, cache_dir=str(tmp_path / "cache"))
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # temp dirs of failed conversions are removed


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="bert") as info:
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_engine_on_gguf_matches_hf_on_the_dequantized_weights(tmp_path: Path, tok, qtype: str, model_type: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine, given the .gguf path, generates what HF generates from the dequantized weights
    (phi3: the fused projections kept as blocks, a window, and LongRoPE's switch inside the output)."""
    from roseinfer import LLM
    from tiny_models import assert_greedy_matches_hf_on_the_fp32_folder

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_model(model_type, len(tok))
    with torch.no_grad():  # scale up so greedy logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, tok, qtype)
    llm = LLM(model=str(src), num_kv_blocks=32)
    assert_greedy_matches_hf_on_the_fp32_folder(llm, src)
