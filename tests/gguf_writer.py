"""Write tiny Hugging Face models to GGUF the way llama.cpp's convert_hf_to_gguf.py does.

Used by the GGUF loader tests (and reusable by others): the files carry the same metadata
keys, tensor names, q/k rotary permutation (llama family) and Conv1D transposes (gpt2) as
real llama.cpp files, so converting them back checks the loader against the real format.

    tok = make_tiny_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), ...))
    write_tiny_gguf(tmp_path / "m.gguf", model, tok, "Q8_0")
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf_quantizers import encode_weights
from gguf_writer_hybrid import HYBRID_ARCH, add_hybrid_metadata, hybrid_gguf_tensors

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello world, this is a tiny tokenizer for tests: 0123456789 !?",
]

_LLAMA_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3's fused projections
    # mixtures of experts: the router, the shared expert and its gate (the stacked experts: _expert_tensors)
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
_GEMMA_BLOCK = _LLAMA_BLOCK | {
    "pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
_GEMMA4_BLOCK = _GEMMA_BLOCK | {
    "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
}  # fmt: skip
_LLAMA_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GEMMA4_GLOBAL = _LLAMA_GLOBAL | {
    "model.embed_tokens_per_layer": "per_layer_token_embd", "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}  # fmt: skip
_GPT2_BLOCK = {
    "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
}  # fmt: skip
_GPT2_GLOBAL = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm"}
# llama.cpp writes mistral as llama.
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2", "phi3": "phi3",
         "smollm3": "smollm3", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma4_text": "gemma4",
         "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe", **HYBRID_ARCH}
_PERMUTED = ("llama", "smollm3")  # convert_hf_to_gguf's LlamaModel and its subclasses
# Byte offsets of the fp16 scale fields (d, dmin) inside one K-quant block (ggml-common.h).


def make_tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) with ChatML special tokens and a chat template.

    The full 256-byte alphabet is included so any text encodes; vocab_size must be > 259.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute: HF half-split rotary rows -> ggml adjacent pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_names(hf_model: torch.nn.Module) -> dict[str, str]:
    """HF state-dict name -> GGUF tensor name, for the tensors write_tiny_gguf stores."""
    model_type = hf_model.config.model_type
    if model_type == "gpt2":
        block_prefix, block, glob = "transformer.h.", _GPT2_BLOCK, _GPT2_GLOBAL
    else:
        block = {"gemma4_text": _GEMMA4_BLOCK}.get(model_type, _GEMMA_BLOCK if model_type.startswith("gemma")
                                                    else _LLAMA_BLOCK)
        block_prefix, glob = "model.layers.", _GEMMA4_GLOBAL if model_type == "gemma4_text" else _LLAMA_GLOBAL
    names: dict[str, str] = {}
    for hf_name in _expert_tensors(hf_model.state_dict()):
        stem, _, suffix = hf_name.rpartition(".")
        if suffix == "layer_scalar":  # Gemma 4's per-layer output scale, a buffer; llama.cpp adds .weight
            names[hf_name] = f"blk.{stem.rpartition('.')[2]}.layer_output_scale.weight"
        elif stem.startswith(block_prefix):
            layer, _, rest = stem[len(block_prefix) :].partition(".")
            if rest == "mlp.experts":  # stacked [E, out, in], as convert_hf_to_gguf merges them
                names[hf_name] = f"blk.{layer}.ffn_{suffix.removesuffix('_proj')}_exps.weight"
            elif rest in block:
                names[hf_name] = f"blk.{layer}.{block[rest]}.{suffix}"
        elif stem in glob:
            names[hf_name] = f"{glob[stem]}.{suffix}"
    if model_type == "gpt2":  # llama.cpp always writes gpt2's (tied) head as its own tensor
        names["lm_head.weight"] = "output.weight"
    elif hf_model.config.tie_word_embeddings:
        names.pop("lm_head.weight", None)  # tied: no output.weight, like llama.cpp
    return names


def _expert_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict with transformers 5's stacked experts' gate_up_proj [E, 2 w, H] split into
    gate_proj and up_proj [E, w, H], the tensors llama.cpp's converter writes."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=-2)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = tensor
    return out


def _add_moe_metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    """convert_hf_to_gguf's expert counts and widths, and OLMoE's clamp."""
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "clip_qkv", None) is not None:
        w.add_clamp_kqv(cfg.clip_qkv)


def write_tiny_gguf(
    path: str | Path, hf_model: torch.nn.Module, tokenizer: Any | None = None, qtype: str | QT = QT.F32,
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Write hf_model (llama / mistral / qwen2 / qwen3 / gpt2 / phi3 / smollm3 / gemma2 / gemma3 / gemma4) as a
    GGUF file and return its path.

    tokenizer: a byte-level BPE fast tokenizer (e.g. make_tiny_tokenizer()) whose vocab, merges,
    special tokens and chat template go into the metadata, or None for no tokenizer at all.
    qtype: GGML type name or enum for the 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, ...).
    qtypes: another type for some kinds of tensor, by GGUF kind ("attn_v": "Q6_K", as llama.cpp's
    Q4_K_M mixes them).
    """
    path = Path(path)
    qtype = QT[qtype] if isinstance(qtype, str) else qtype
    cfg = hf_model.config
    model_type = cfg.model_type
    arch = _ARCH[model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{model_type}")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if model_type == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        if model_type == "gemma4_text":  # key_length is the global layers' head dim (_add_gemma4_metadata)
            cfg.allow_global_per_layer_attribute_access = True
            head_dim = max(cfg.per_layer_config[i].head_dim for i in range(cfg.num_hidden_layers))
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        if not getattr(cfg, "use_double_wide_mlp", False) and getattr(cfg, "intermediate_size", None):
            w.add_feed_forward_length(cfg.intermediate_size)  # Qwen3.5-MoE has none
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        if model_type != "gemma4_text":
            w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if model_type not in ("gemma3_text", "gemma4_text"):  # rope per layer type: _add_gemma_metadata
            w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_key_length(head_dim)  # convert_hf_to_gguf writes these when config has head_dim
        w.add_value_length(head_dim)
        if hasattr(cfg, "num_experts_per_tok"):
            _add_moe_metadata(w, cfg)
        if model_type in HYBRID_ARCH:
            add_hybrid_metadata(w, cfg)
        if arch.startswith("gemma"):
            _add_gemma_metadata(w, cfg)
        else:
            _add_rope_scaling(w, cfg, rope)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer is not None:
        _add_tokenizer(w, tokenizer)

    rng = np.random.default_rng(0)
    state = {k: v.detach().float().numpy() for k, v in _expert_tensors(hf_model.state_dict()).items()}
    names = gguf_tensor_names(hf_model)
    if model_type in HYBRID_ARCH:  # the state in GGUF's names and stored forms already
        state = hybrid_gguf_tensors(state, cfg, names)
        names = {name: name for name in state}
    for hf_name, gguf_name in names.items():
        data = state.get(hf_name, state.get("transformer.wte.weight") if hf_name == "lm_head.weight" else None)
        if gguf_name.endswith("layer_output_scale.weight"):
            data = data.reshape(1)
        assert data is not None, hf_name
        if arch in _PERMUTED and ".attn_q." in gguf_name:
            data = llama_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch in _PERMUTED and ".attn_k." in gguf_name:
            data = llama_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        elif arch == "gpt2" and gguf_name.split(".")[-2] in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            data = data.T if gguf_name.endswith(".weight") else data  # Conv1D (in, out) -> (out, in)
        elif arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # convert_hf_to_gguf stores the (1 + w) Gemma scales by
        kind = gguf_name.split(".")[-2] if gguf_name.count(".") >= 2 else ""
        tensor_type = QT[qtypes[kind]] if qtypes and kind in qtypes else qtype
        stored, stored_type = encode_weights(np.ascontiguousarray(data), tensor_type, rng)
        if stored_type in (QT.F32, QT.F16):
            w.add_tensor(gguf_name, stored)
        else:
            w.add_tensor(gguf_name, stored, raw_dtype=stored_type)
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gemma_metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    """What convert_hf_to_gguf's Gemma2Model / Gemma3Model add: the window, soft-caps and (Gemma 3)
    the global layers' rope; llama.cpp fixes the layer pattern, the local rope base and the query scale."""
    w.add_sliding_window(cfg.sliding_window)
    if cfg.model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        return
    if cfg.model_type == "gemma4_text":
        _add_gemma4_metadata(w, cfg)
        return
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    full = cfg.rope_parameters["full_attention"]
    w.add_rope_freq_base(float(full["rope_theta"]))
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))


def _add_gemma4_metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    """Gemma4Model's: per-layer lists where layers differ, global head dim as key_length and the
    sliding one as key_length_swa, and a rope_freqs tensor marking the unrotated pairs (1e30)."""
    layers = range(cfg.num_hidden_layers)
    shapes = [(cfg.per_layer_config[i].num_key_value_heads, cfg.per_layer_config[i].head_dim) for i in layers]
    sliding = [kind == "sliding_attention" for kind in cfg.layer_types]
    global_dim = next(dim for (_, dim), s in zip(shapes, sliding) if not s)
    swa_dim = next(dim for (_, dim), s in zip(shapes, sliding) if s)
    w.add_sliding_window_pattern(sliding)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_head_count_kv([heads for heads, _ in shapes])
    shared_from = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    if cfg.use_double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (2 if i >= shared_from else 1) for i in layers])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    w.add_rope_freq_base(float(full["rope_theta"]))
    w.add_rope_freq_base_swa(float(local["rope_theta"]))
    rotated = int(global_dim * full["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated), np.float32))


def _add_rope_scaling(w: gguf.GGUFWriter, cfg: Any, rope: dict[str, Any]) -> None:
    """YaRN as convert_hf_to_gguf's TextModel writes it; Phi-3's window and LongRoPE metadata as its
    Phi3MiniModel does (the factors themselves are tensors)."""
    if cfg.model_type == "phi3":
        w.add_sliding_window(cfg.sliding_window or 0)  # 0: no window
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)) if scale > 1 else 1.0)
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _add_tokenizer(w: gguf.GGUFWriter, tokenizer: Any) -> None:
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    assert model["type"] == "BPE", "write_tiny_gguf only handles byte-level BPE tokenizers"
    vocab = tokenizer.get_vocab()  # includes added tokens
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    special = set(tokenizer.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    for attr, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                      ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):  # fmt: skip
        if (token_id := getattr(tokenizer, f"{attr}_token_id", None)) is not None:
            add(token_id)
    w.add_add_bos_token(False)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
