"""A tiny model that thinks: the tiny qwen3 checkpoint with Qwen3's `<think>` / `</think>` tokens and
chat templates that open or skip the reasoning (the reasoning parsers' tests)."""
from __future__ import annotations

import json
import pathlib

import torch

from tiny_models import build_tiny_model

THINK_TAGS = ["<think>", "</think>"]
# Qwen3's template, cut down: earlier turns' reasoning dropped, and with enable_thinking false an
# empty reasoning closed in the prompt
QWEN3_THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's and Qwen3-Thinking-2507's way: the generation prompt opens the reasoning, so the
# reply starts inside it (unless enable_thinking is false)
OPEN_THINKING_TEMPLATE = QWEN3_THINKING_TEMPLATE.replace(
    "{% endif %}{% endif %}", "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def build_thinking_model(out_dir: str | pathlib.Path) -> pathlib.Path:
    """The tiny qwen3 checkpoint with `<think>` and `</think>` as added tokens that are not special
    (as in Qwen3's tokenizer), the embedding grown by their two rows, and QWEN3_THINKING_TEMPLATE."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_model("qwen3", out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    old_vocab = len(tokenizer)
    tokenizer.add_tokens(THINK_TAGS)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # the new rows at _randomize's scale, so the tags compete with other tokens
        gen = torch.Generator().manual_seed(2000)
        rows = model.get_input_embeddings().weight[old_vocab:]
        rows.copy_(torch.randn(rows.shape, generator=gen) * 0.2)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=QWEN3_THINKING_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
