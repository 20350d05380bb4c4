"""A tiny gpt-oss that speaks harmony: the tiny gpt_oss checkpoint with harmony's markers as special
tokens and a cut-down gpt-oss chat template (the harmony parser's tests)."""
from __future__ import annotations

import json
import pathlib

import torch

from tiny_models import build_tiny_model

HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# gpt-oss's template, cut down: tools shown in a developer message, earlier replies as their final
# channel, tool results from functions.NAME, the reply's header opened
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<|start|>assistant to=functions.{{ call['function']['name'] }}<|channel|>commentary json<|message|>"
    "{{ call['function']['arguments'] }}<|call|>{% endfor %}"
    "{% if message['content'] %}<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>{% endif %}"
    "{% elif message['role'] == 'tool' %}"
    "<|start|>functions.{{ message.get('name', 'tool') }} to=assistant<|channel|>commentary<|message|>"
    "{{ message['content'] }}<|end|>"
    "{% else %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def build_harmony_model(out_dir: str | pathlib.Path) -> pathlib.Path:
    """The tiny gpt_oss checkpoint with HARMONY_MARKERS as special tokens (as in o200k_harmony), the
    embedding and LM head grown by their rows, HARMONY_TEMPLATE, and <|return|> and <|call|> ending
    generation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = build_tiny_model("gpt_oss", out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    old_vocab = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # the new rows at _randomize's scale, so the markers compete with other tokens
        gen = torch.Generator().manual_seed(2001)
        for table in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            rows = table[old_vocab:]
            rows.copy_(torch.randn(rows.shape, generator=gen) * 0.2)
    stops = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    model.config.eos_token_id = stops
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=stops[0], do_sample=False)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=HARMONY_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
