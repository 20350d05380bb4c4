"""Tokenizer (transformers' fast tokenizer) plus an incremental, UTF-8 safe detokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_ids = _eos_ids(Path(folder), self.hf)
        self.vocab_size = len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        ids = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def _eos_ids(folder: Path, hf: Any) -> set[int]:
    """EOS ids from generation_config.json (what HF generate stops on) and the tokenizer."""
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if hf.eos_token_id is not None:
        ids.add(hf.eos_token_id)
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a small window (from a few tokens back to the end), so each call costs
    O(new tokens); holds text back while the window ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD), so it never emits half a character. The prompt's last tokens seed the
    window so that the first word's leading space comes out as the full decode would give it.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix, full = self._window_texts()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        return self._emit(full[len(prefix):])

    def flush(self) -> str:
        """Release what is still held back when the stream ends, as the full decode shows it
        (U+FFFD for a truly incomplete character), so the streamed text equals decode(all ids)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix, full = self._window_texts()
        return self._emit(full[len(prefix):])

    def _window_texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        return prefix, decode(self.ids[self.prefix_offset:], self.skip_special_tokens)

    def _emit(self, delta: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # keep the window short: drop ids that can no longer affect decoding
        if self.prefix_offset > 64:
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        self.text += delta
        return delta
