"""Write a randomly initialised checkpoint of a real model's shape, for benchmarks on machines that
cannot download one (the GPU figures in benchmarks/README.md): config.json and safetensors as
`save_pretrained` writes them, and a byte-level tokenizer (256 byte tokens and <|endoftext|>, no
merges), so text prompts work; the model's vocabulary stays its real size. With --tokenizer-from GGUF
the tokenizer is instead the one transformers rebuilds from that file (the default model's, a real
BPE one that llama.cpp's convert_hf_to_gguf.py recognises; it pads a larger vocabulary itself).
Random weights make random text: benchmark them with --ignore-eos / --no-stop-on-eos.

Usage: python benchmarks/random_model.py SHAPE OUT_DIR [--dtype bfloat16] [--num-layers N] [--tokenizer-from GGUF]
SHAPE: gpt2-small (the roseinfer blog's benchmark model), qwen3-0.6b (nano-vllm's), tiny-llama (a step
so short that the server's own costs show: benchmarks/server_overhead.py), the CPU shapes people
run quantized (benchmarks/cpu_gguf_peers.py): smollm2-1.7b, llama-3.2-3b, qwen3-8b, gemma3-1b, or qwen3-30b-a3b
(Qwen3-30B-A3B's layer shape: 128 experts, top-8, expert width 768; pick the layers that fit with
--num-layers), or qwen3.5-small (the hybrid layer shape: benchmarks/hybrid_prefix_cost.py, and issue 40's table against
llama.cpp, benchmarks/cpu_gguf_peers.py --shape qwen3.5-small).

The mixture-of-experts comparison against llama.cpp (issue 39's table) is benchmarks/cpu_gguf_peers.py
--shape qwen3-30b-a3b --num-layers N (it builds, converts and quantizes this checkpoint itself).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

EOS = "<|endoftext|>"
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2-small": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
                   "vocab_size": 50257},
    "qwen3-0.6b": {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
                      "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "vocab_size": 151936,
                      "tie_word_embeddings": False},
    "tiny-llama": {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 384,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "vocab_size": 384},
    "smollm2-1.7b": {"model_type": "llama", "num_hidden_layers": 24, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
                     "rope_theta": 130_000.0, "rms_norm_eps": 1e-5, "vocab_size": 49152, "tie_word_embeddings": True},
    "llama-3.2-3b": {"model_type": "llama", "num_hidden_layers": 28, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131072, "rope_theta": 500_000.0, "rms_norm_eps": 1e-5,
                     "vocab_size": 128256, "tie_word_embeddings": True},
    "gemma3-1b": {"model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 1152, "intermediate_size": 6912,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
                  "query_pre_attn_scalar": 256, "max_position_embeddings": 32768, "vocab_size": 262144},
    "qwen3-8b": {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
                 "vocab_size": 151936, "tie_word_embeddings": False},
    # Qwen3.5's layer shape (hybrid: 3 Gated DeltaNet layers to 1 gated full-attention one, 16 linear
    # heads of 128, full-attention heads of 256 with a quarter rotating) at hidden 1024
    "qwen3.5-small": {"model_type": "qwen3_5_text", "num_hidden_layers": 24, "hidden_size": 1024,
                      "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                      "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 32768,
                      "rms_norm_eps": 1e-6, "vocab_size": 248320, "tie_word_embeddings": True},
    # gpt-oss-20b's: 32 experts of width 2880, top-4, attention sinks, 128-token sliding layers between
    # full ones; llama.cpp's converter writes its experts BF16 from this dense checkpoint, llama-quantize
    # MXFP4_MOE makes them MXFP4 (the rest Q8_0), as the published GGUFs hold them
    "gpt-oss-20b": {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "swiglu_limit": 7.0,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "vocab_size": 201088,
                    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096,
                                        "rope_theta": 150000.0},
                    "tie_word_embeddings": False},
}
LAYER_KEYS = {"gpt2": "n_layer", "qwen3": "num_hidden_layers", "llama": "num_hidden_layers",
              "qwen3_moe": "num_hidden_layers", "gemma3_text": "num_hidden_layers", "qwen3_5_text": "num_hidden_layers",
              "gpt_oss": "num_hidden_layers"}


def write_tokenizer(out: Path, max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {EOS: 0, **{symbol: i + 1 for i, symbol in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": max_length}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def copy_gguf_tokenizer(gguf: Path, out: Path, vocab_size: int) -> None:
    """The tokenizer transformers rebuilds from a GGUF's metadata, saved into out, padded with unused
    special tokens to the model's vocabulary: Gemma's converter cuts the embedding to the tokenizer's size.
    They are added tokens, not `additional_special_tokens`: transformers checks each of those against a
    list on load, which at Qwen3.5's 200k extra tokens kept the converter loading it for many minutes."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.add_tokens([AddedToken(f"<unused{i}>", special=True) for i in range(vocab_size - len(tokenizer))])
    tokenizer.save_pretrained(str(out))


def write_model(shape: str, out: Path, dtype: torch.dtype, num_layers: int | None = None, seed: int = 0,
                tokenizer_from: Path | None = None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(SHAPES[shape])
    model_type = values.pop("model_type")
    if num_layers is not None:
        values[LAYER_KEYS[model_type]] = num_layers
    config = AutoConfig.for_model(model_type, bos_token_id=0, eos_token_id=0, pad_token_id=0, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="1GB")  # serialising a shard holds a copy of it
    if tokenizer_from is None:
        write_tokenizer(out, config.max_position_embeddings)
    else:
        copy_gguf_tokenizer(tokenizer_from, out, config.vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                        help="dtype of the saved weights (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape's (for tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF whose tokenizer to save instead")
    args = parser.parse_args()
    write_model(args.shape, args.out_dir, getattr(torch, args.dtype), args.num_layers, args.seed, args.tokenizer_from)
    print(f"wrote a random {args.shape} to {args.out_dir}")


if __name__ == "__main__":
    main()
