"""Write a tiny gpt-oss as llama.cpp's converter (conversion/gpt_oss.py GptOssModel) writes it:
architecture `gpt-oss`, the experts split into gate / up / down [E, out, in] with their biases, in
MXFP4, the sinks as `attn_sinks.weight`, the router as `ffn_gate_inp` with its bias."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from gguf_writer import _add_tokenizer

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def mxfp4_round_trip(values: torch.Tensor) -> torch.Tensor:
    """What a tensor [..., in] reads as once stored in MXFP4 (gguf-py's quantizer) and dequantized."""
    data = values.detach().float().numpy()
    stored = gguf.quants.quantize(np.ascontiguousarray(data), QT.MXFP4)
    return torch.from_numpy(gguf.quants.dequantize(stored, QT.MXFP4).reshape(data.shape).copy())


def split_experts(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """A layer's experts as the converter splits them: gate / up [E, w, H] from the interleaved
    gate_up [E, H, 2 w], down [E, H, w], and their biases."""
    prefix = f"model.layers.{layer}.mlp.experts."
    gate_up, bias = state[prefix + "gate_up_proj"], state[prefix + "gate_up_proj_bias"]
    return {"ffn_gate_exps.weight": gate_up[..., 0::2].transpose(1, 2), "ffn_up_exps.weight": gate_up[..., 1::2].transpose(1, 2),
            "ffn_down_exps.weight": state[prefix + "down_proj"].transpose(1, 2),
            "ffn_gate_exps.bias": bias[..., 0::2], "ffn_up_exps.bias": bias[..., 1::2],
            "ffn_down_exps.bias": state[prefix + "down_proj_bias"]}


def write_gpt_oss_gguf(path: Path, hf_model: Any, tokenizer: Any) -> Path:
    cfg = hf_model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(w, tokenizer)
    state = hf_model.state_dict()
    tensors: dict[str, torch.Tensor] = {gguf_name: state[hf] for hf, gguf_name in _GLOBAL.items()}
    for layer in range(cfg.num_hidden_layers):
        for hf, kind in _BLOCK.items():
            for suffix in ("weight", "bias"):
                if f"model.layers.{layer}.{hf}.{suffix}" in state:
                    tensors[f"blk.{layer}.{kind}.{suffix}"] = state[f"model.layers.{layer}.{hf}.{suffix}"]
        tensors[f"blk.{layer}.attn_sinks.weight"] = state[f"model.layers.{layer}.self_attn.sinks"]
        tensors.update({f"blk.{layer}.{name}": t for name, t in split_experts(state, layer).items()})
    for name, tensor in tensors.items():
        data = np.ascontiguousarray(tensor.detach().float().numpy())
        if "_exps.weight" in name:
            w.add_tensor(name, gguf.quants.quantize(data, QT.MXFP4), raw_dtype=QT.MXFP4)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gpt_oss_gguf_and_reference(model_dir: Path, out: Path, tokenizer: Any) -> tuple[Path, Path]:
    """(the tiny checkpoint at model_dir written as llama.cpp's `gpt-oss` file, an HF folder holding what
    that file holds: the checkpoint with llama.cpp's fixed clamp of 7.0 and its experts MXFP4-rounded)."""
    from transformers import AutoModelForCausalLM

    source = out / "gpt_oss"
    shutil.copytree(model_dir, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "swiglu_limit": 7.0}))
    hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    src = write_gpt_oss_gguf(out / "gpt-oss.gguf", hf, tokenizer)
    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(mxfp4_round_trip(experts.gate_up_proj.transpose(1, 2)).transpose(1, 2))
            experts.down_proj.copy_(mxfp4_round_trip(experts.down_proj.transpose(1, 2)).transpose(1, 2))
    hf.save_pretrained(str(source))
    return src, source
