"""Tiny random checkpoints and the HF transformers reference they are tested against.

Everything here is built offline in a few seconds: a byte-level BPE tokenizer trained on a
generated English corpus, and one small randomly initialised model per supported
architecture, saved exactly the way `save_pretrained` writes real checkpoints. The engine's
correctness tests compare its greedy output token-for-token with `hf_greedy`.
"""

from __future__ import annotations

import json
import pathlib
import random
from functools import lru_cache
from typing import Any

import torch
from tiny_family_configs import deepseek_config, gemma_config, gpt_oss_config, hybrid_config, moe_config


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Same order as SmolLM2 / Qwen-style vocabularies, so the special ids are 0, 1, 2.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
VOCAB_SIZE = 384

# ChatML, as shipped by SmolLM2-Instruct and Qwen2 (minus their default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHS: list[str] = ["gpt2", "llama", "llama3_rope_untied", "mistral", "qwen2", "qwen3", "llama_mqa",
                    "qwen2_sliding", "phi3_longrope", "smollm3_yarn", "gemma2", "gemma3", "gemma4"]
# Built on demand (tiny_model_factory), not run by every arch-parametrized test: every layer of
# mistral_sliding slides, so its KV blocks go back to the pool as sequences grow and the pools that
# those tests size to force preemption no longer run short (tests/test_sliding_window.py runs it).
# qwen3_5 (linear-attention layers with a state pool) refuses prefix caching and speculation, which
# arch-parametrized tests exercise; tests/test_hybrid.py runs it through every other mode.
EXTRA_ARCHS: list[str] = ["mistral_sliding", "deepseek_v2_lite", "deepseek_v3", "qwen3_5"]
# Mixtures of experts (models/moe.py): 8 experts, top-2 (OLMoE top-3, so three sums' order counts),
# tests/test_moe.py runs them through every scheduling mode and backend.
MOE_ARCHS: list[str] = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
EXTRA_ARCHS += MOE_ARCHS
# gpt-oss (models/gpt_oss.py): attention sinks, a biased router, the clamped SwiGLU; tests/test_gpt_oss.py
EXTRA_ARCHS.append("gpt_oss")
# Qwen3-Next and Qwen3.5-MoE: qwen3_5's hybrid stack with a mixture of experts and a gated shared
# expert; tests/test_hybrid.py runs all three
HYBRID_ARCHS: list[str] = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
EXTRA_ARCHS += HYBRID_ARCHS[1:]

# Weights that do not move when archs are added before these ones: the speculative tests need a
# model that continues a repeated pattern, and the references must be far from ties
# (test_reference_not_degenerate), which some draws of random weights do not give.
PINNED_SEEDS: dict[str, int] = {"phi3_longrope": 7, "smollm3_yarn": 8, "gemma2": 8, "gemma3": 9, "gemma4": 10,
                                "qwen3_5": 11, "olmoe": 21}

# Sliding windows far shorter than the test prompts, so that every mode attends across a window's edge.
SLIDING_WINDOW = 8

# Archs whose weights are saved in several shards, so the engine's loader must follow
# model.safetensors.index.json. The whole model is ~0.5 MB, so 150KB gives 3-5 shards.
SHARDED_ARCHS = {"mistral": "150KB"}

# --------------------------------------------------------------------------- corpus

_SUBJECTS = ["the cat", "a small dog", "my neighbour", "the old teacher", "our team", "the robot",
             "a young girl", "the farmer", "this program", "the river", "every student", "the king"]
_VERBS = ["sees", "likes", "writes", "builds", "finds", "carries", "remembers", "paints",
          "follows", "opens", "counts", "answers"]
_OBJECTS = ["a red apple", "the long letter", "three green boxes", "the quiet house", "a map",
            "the broken window", "some fresh bread", "the answer", "a strange light", "the door"]
_ADVERBS = ["slowly", "quickly", "every morning", "at night", "without a word", "again",
            "in the garden", "near the station", "before lunch", "with great care"]
_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
              "Why is the sky blue?", "Can you write a short poem?", "Where do penguins live?",
              "What time is it in Tokyo?", "Who wrote this story?", "Is water wet?"]
_EXTRA = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
          "The price is $42.50 (about 39 euros).", "Call 555-0199 before 6:30 pm!",
          "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024.", "Café, naïve, façade, résumé.",
          "x = [1, 2, 3]; y = {'a': 1}", "Hello, world! Hello, world!", "E = mc^2 and a^2 + b^2 = c^2"]


@lru_cache(maxsize=None)
def corpus(n_sentences: int = 400, seed: int = 0) -> tuple[str, ...]:
    """Deterministic, varied English-ish text: templated sentences plus code, numbers, accents."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_sentences):
        kind = i % 4
        if kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}."
            s = s[0].upper() + s[1:]
        elif kind == 1:
            s = (f"When {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}, "
                 f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} it {rng.choice(_ADVERBS)}.")
            s = s[0].upper() + s[1:]
        elif kind == 2:
            s = rng.choice(_QUESTIONS) + " " + rng.choice(_EXTRA)
        else:
            s = f"{rng.randint(1, 999)} {rng.choice(_OBJECTS)} and {rng.randint(1, 99)} more, said {rng.choice(_SUBJECTS)}."
        lines.append(s)
    return tuple(lines)


# --------------------------------------------------------------------------- tokenizer

@lru_cache(maxsize=1)
def _trained_tokenizer() -> Any:
    """Train the byte-level BPE once per process (~0.1 s); every caller gets the same one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # GPT-2 / Qwen style: no prefix space, byte fallback covers all of UTF-8 via the 256-symbol alphabet.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # Special-token conventions mirror SmolLM2-Instruct (the engine's default model):
    # bos=<|im_start|>, eos=pad=<|im_end|>, unk=<|endoftext|>. No BOS is auto-prepended.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


def train_tokenizer(out_dir: str | pathlib.Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with `chat_template`) into out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _trained_tokenizer().save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja; real checkpoints of the
    # previous generation keep it inside tokenizer_config.json, which is what we promise here.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # v5 writes its internal "TokenizersBackend" class name; real checkpoints name a class
    # every transformers version (and AutoTokenizer in v5) resolves.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


def special_ids() -> dict[str, int]:
    tok = _trained_tokenizer()
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


# --------------------------------------------------------------------------- models

def _config(arch: str) -> Any:
    """Tiny configs: hidden 64, 2 layers, 4 heads, 2 kv heads (GQA), ffn 128, 256 positions."""
    from transformers import (GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                              SmolLM3Config)

    ids = special_ids()
    vocab = len(_trained_tokenizer())
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        bos_token_id=ids[IM_START], eos_token_id=ids[IM_END], pad_token_id=ids[IM_END],
    )
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_inner=128,
                          n_positions=256, bos_token_id=ids[IM_START], eos_token_id=ids[IM_END],
                          pad_token_id=ids[IM_END], activation_function="gelu_new")
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "llama3_rope_untied":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        # Non-default theta and eps so a loader that ignores them produces different tokens.
        return Qwen2Config(**common, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "qwen3":
        # head_dim (32) != hidden/heads (16): q/o projections are 64<->128, k/v 64->64.
        return Qwen3Config(**{**common, "num_attention_heads": 4}, head_dim=32, rms_norm_eps=1e-6,
                           rope_theta=1_000_000.0, tie_word_embeddings=True)
    if arch == "llama_mqa":
        return LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=False)
    if arch.startswith("gemma"):
        return gemma_config(arch, common, SLIDING_WINDOW)
    if arch.startswith("deepseek"):
        return deepseek_config(arch, common)
    if arch in MOE_ARCHS:
        return moe_config(arch, common)
    if arch == "gpt_oss":
        return gpt_oss_config(common, SLIDING_WINDOW)
    if arch == "mistral_sliding":  # every layer slides
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)
    if arch == "qwen2_sliding":  # layer 0 attends the whole context, layer 1 slides
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1,
                           tie_word_embeddings=True)
    if arch in HYBRID_ARCHS:
        return hybrid_config(arch, common)
    if arch == "phi3_longrope":
        # Phi-4-mini's shape in small: 3/4 of each head rotates (12 of 16 dims: 6 factors each), and
        # LongRoPE's original context (48) is shorter than the test prompts, so both factor sets run.
        # No window: Phi-3's slides in every layer, as mistral_sliding's does (EXTRA_ARCHS says why not here).
        return Phi3Config(**common, partial_rotary_factor=0.75, original_max_position_embeddings=48,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
                                        "long_factor": [1.2, 1.9, 3.5, 6.0, 11.0, 19.0]},
                          tie_word_embeddings=False)
    if arch == "smollm3_yarn":
        # every 2nd layer has no rotary (NoPE) and slides (use_sliding_window); YaRN from an original 64
        return SmolLM3Config(**common, no_rope_layer_interval=2, rope_theta=20000.0, use_sliding_window=True,
                             sliding_window=24,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + EXTRA_ARCHS}")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter with a large scale.

    HF's default init (std 0.02, norms = 1, biases = 0) gives nearly flat logits, so greedy
    decoding would hinge on 1e-6 ties and hide loader bugs: zero biases and unit norm
    weights are indistinguishable from missing ones. Here matrices get std 0.2, norm
    weights 1 +- 0.2 and biases +- 0.2, so every tensor matters and top-2 gaps are large.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()  # tied embedding/lm_head share storage; draw it once
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.ndim >= 2:
            p.copy_(noise * 0.2)
        elif name.endswith("bias"):
            p.copy_(noise * 0.2)
        else:  # RMSNorm / LayerNorm scale (incl. qwen3 q_norm/k_norm)
            p.copy_(1.0 + noise * 0.2)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, saved with the weights
            buffer.copy_(1.0 + torch.randn(buffer.shape, generator=gen) * 0.2)
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, saved with the weights
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.2)


def build_tiny_model(arch: str, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Write a complete HF checkpoint folder for `arch` into out_dir and return its path.

    Contents: config.json, generation_config.json, model.safetensors (or shards + index for
    SHARDED_ARCHS), tokenizer.json, tokenizer_config.json (transformers 5 writes no
    special_tokens_map.json; the special tokens live in tokenizer_config.json).
    Deterministic: the same arch always gets the same weights.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would swamp pytest -s output
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch)
    seed = PINNED_SEEDS.get(arch, (ARCHS + EXTRA_ARCHS).index(arch))
    torch.manual_seed(seed)  # HF's own init, before we overwrite it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=1000 + seed)
    if arch.startswith("gemma") and config.tie_word_embeddings:
        # Gemma multiplies embeddings by sqrt(hidden): unscaled, a tied table makes every token
        # predict itself. Trained tables are that much smaller; so is this one.
        with torch.no_grad():
            model.get_input_embeddings().weight.div_(config.hidden_size ** 0.5)
    model.eval()
    ids = special_ids()
    # Like Qwen2-Instruct: generation stops on either <|im_end|> or <|endoftext|>, so the
    # engine must accept a list here while config.json carries a single int.
    model.generation_config = GenerationConfig(
        bos_token_id=ids[IM_START], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[IM_END], do_sample=False,
    )
    model.save_pretrained(str(out), max_shard_size=SHARDED_ARCHS.get(arch, "50GB"))
    train_tokenizer(out)
    return out


# --------------------------------------------------------------------------- reference

@lru_cache(maxsize=None)
def _load_hf(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # transformers 5 renamed torch_dtype -> dtype. Eager attention is the plainest maths.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    # Passing eos_token_id=None to generate() does not override the saved generation_config
    # (None means "unset" and falls back to it), so switch EOS off on the cached model itself.
    model.generation_config.eos_token_id = None
    return model.eval()


def load_hf_model(model_dir: str | pathlib.Path) -> Any:
    """The cached float32 HF model for a folder (shared with hf_greedy)."""
    return _load_hf(str(pathlib.Path(model_dir).resolve()))


def hf_greedy(model_dir: str | pathlib.Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Pure argmax continuation of one prompt: exactly max_new_tokens new ids, never stopping at EOS.

    EOS is disabled rather than suppressed (min_new_tokens would mask EOS logits and change the
    argmax), so an engine run with ignore_eos matches this list exactly, and one that stops at
    EOS matches its prefix up to and including the EOS id.

    Generated once a session per folder, prompt and length: tests in every mode and module ask for
    the same references again (test_reference_is_cached_and_repeatable generates anew to compare).
    """
    return list(_hf_greedy_cached(str(pathlib.Path(model_dir).resolve()), tuple(prompt_ids), max_new_tokens))


@lru_cache(maxsize=None)
def _hf_greedy_cached(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    return tuple(hf_greedy_generate(model_dir, list(prompt_ids), max_new_tokens))


@torch.no_grad()
def hf_greedy_generate(model_dir: str | pathlib.Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """hf_greedy's run of HF's generate, every time it is called."""
    model = load_hf_model(model_dir)
    pad = model.generation_config.pad_token_id
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0 if pad is None else pad)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, f"HF stopped early: {len(new)} < {max_new_tokens}"
    return new


@torch.no_grad()
def hf_prompt_logprobs(model_dir: str | pathlib.Path, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt_ids), vocab] log-softmax of HF's logits over the prompt: row p is the
    distribution of token p + 1."""
    logits = load_hf_model(model_dir)(torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


# --------------------------------------------------------------------------- prompts

def sample_prompts(tokenizer_dir: str | pathlib.Path, n: int, seed: int, max_len: int = 100) -> list[list[int]]:
    """n token-id prompts with lengths spread over [1, max_len] (1 and max_len always included
    when n >= 2), cut from shuffled corpus text so they look like real tokenised input."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    rng = random.Random(seed)
    if n == 1:
        lengths = [rng.randint(1, max_len)]
    else:  # evenly spaced with jitter, endpoints pinned, then shuffled
        step = (max_len - 1) / (n - 1)
        lengths = [round(1 + i * step) for i in range(n)]
        lengths = [lengths[0]] + [max(1, min(max_len, ln + rng.randint(-2, 2))) for ln in lengths[1:-1]] + [lengths[-1]]
        rng.shuffle(lengths)
    lines = list(corpus())
    prompts: list[list[int]] = []
    for length in lengths:
        ids: list[int] = []
        while len(ids) < length:
            ids += tok.encode(" ".join(rng.sample(lines, 4))).ids
        prompts.append(ids[:length])
    return prompts


def assert_greedy_matches_hf_on_the_fp32_folder(llm: Any, gguf_path: str | pathlib.Path) -> None:
    """`llm` (an LLM on the GGUF file) generates, greedy, what HF generates from the file's fp32 folder."""
    from roseinfer import SamplingParams
    from roseinfer.loader.gguf import convert_gguf

    prompts = [[5, 17, 42, 9], list(range(3, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    folder = convert_gguf(gguf_path)
    refs = [hf_greedy(folder, p, 12) for p in prompts]
    assert any(len(set(r)) > 2 for r in refs), "degenerate reference"
    assert [o.token_ids for o in outs] == refs
