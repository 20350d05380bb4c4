"""Tokenizer and an incremental, UTF-8 safe detokenizer.

For a folder with a tokenizer.json, the tokenizer runs on the `tokenizers` library and renders
chat templates with jinja2 itself, reproducing what `transformers.AutoTokenizer` (v5) gives,
without importing transformers (its import alone is a large share of a small server's memory). Folders
without a tokenizer.json (sentencepiece-only) fall back to transformers' AutoTokenizer.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Callable

from roseinfer.chat_template import compile_template, pick_template, template_messages, template_source

# transformers' named special tokens, in the order it adds missing ones to the vocabulary.
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# init kwargs that name files on the server's machine: no use to a client
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._hf: Any = None  # transformers tokenizer: only for folders without tokenizer.json
        self._tok: Any = None  # tokenizers.Tokenizer otherwise
        self._compiled: Any = None  # jinja2 template, compiled on first use
        self._clean_up_spaces = False
        self._config: dict[str, Any] = {}  # tokenizer_config.json (without tokenizer.json: transformers' init kwargs)
        self.special_tokens: dict[str, str]  # name -> text (bos_token, ...), as templates see them
        self.chat_template: str | None
        self.vocab_size: int  # added tokens included, like len(hf_tokenizer)
        eos_id: int | None
        if (folder / "tokenizer.json").is_file():
            cfg = _read_json(folder / "tokenizer_config.json")
            if "added_tokens_decoder" not in cfg:  # legacy file; transformers reads it only then
                cfg.update(_read_json(folder / "special_tokens_map.json"))
            self._tok, self.special_tokens = _load_backend(folder / "tokenizer.json", cfg)
            self._config = cfg
            self.chat_template = template_source(folder, cfg)
            # transformers skips this cleanup for BPE models, where it would eat real spaces
            self._clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces")) and (
                type(self._tok.model).__name__ != "BPE"
                or bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            # every named special token is in the vocabulary by now (see _load_backend)
            eos_token = self.special_tokens.get("eos_token")
            eos_id = None if eos_token is None else self._tok.token_to_id(eos_token)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(folder))
            self._config = {"tokenizer_class": type(self._hf).__name__, **self._hf.init_kwargs}
            self.special_tokens = dict(self._hf.special_tokens_map)
            self.chat_template = pick_template(self._hf.chat_template)
            self.vocab_size = len(self._hf)
            eos_id = self._hf.eos_token_id
        self.eos_token_ids: set[int] = _eos_ids(folder, eos_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (added tokens included), None if it has none."""
        if self._hf is not None:
            return self._hf.get_vocab().get(token)
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if self._hf is not None:
            return self._hf.convert_ids_to_tokens(int(token_id))
        return self._tok.id_to_token(int(token_id))

    def backend_json(self) -> str:
        """The tokenizer in `tokenizers`' JSON form (what grammar libraries read)."""
        backend = self._tok if self._hf is None else getattr(self._hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured output needs a fast tokenizer (tokenizer.json); this model has only a slow one")
        return backend.to_str()

    def info(self) -> dict[str, Any]:
        """The configuration as vLLM's /tokenizer_info gives it: tokenizer_config.json with added
        tokens as their text and no file paths, every named special token (None where the model has
        none), tokenizer_class, and the chat template this tokenizer renders."""
        info = {key: _plain(value) for key, value in self._config.items() if key not in _PATH_KEYS}
        info.update({key: None for key in _SPECIAL_ATTRS if key not in info}, **self.special_tokens)
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # what transformers builds from tokenizer.json
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info

    # ---- text <-> ids ----
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        # encode_batch, not encode: only it releases the GIL, so a long prompt tokenized in a worker
        # thread does not stall the server's event loop (same ids)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def stream_decoder(self, context_ids: list[int],
                       skip_special_tokens: bool = True) -> Callable[[list[int]], str | None] | None:
        """`tokenizers`' incremental decoder (DecodeStream.step: the new ids in, the text they complete
        out, None while held back), its window seeded with context_ids, where it gives what
        IncrementalDetokenizer's Python window gives: None for the transformers fallback, the
        clean-up pass, and a context that ends inside a character (the stream would then emit the
        context's text with the first delta)."""
        if self._hf is not None or self._clean_up_spaces:
            return None
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        held = bool(context_ids) and stream.step(self._tok, context_ids) is None
        if held and self.decode(context_ids, skip_special_tokens):
            return None
        return partial(stream.step, self._tok)

    def render_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                             **template_kwargs: Any) -> str:
        """The conversation as text, rendered the way transformers' apply_chat_template does;
        template_kwargs are extra template variables (e.g. enable_thinking), as there."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template)
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        return self._compiled.render(messages=template_messages(messages), add_generation_prompt=add_generation_prompt,
                                     **variables)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        # The template writes the special tokens itself, so none are added (as in transformers).
        text = self.render_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _plain(value: Any) -> Any:
    """A config value as JSON: an added token (a dict with its content) as its text."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "content"):  # transformers' AddedToken
        return value.content
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_backend(path: Path, cfg: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """tokenizer.json set up as transformers' TokenizersBackend sets it up, and the named special
    tokens. Like transformers, special tokens named in the config that are not yet added tokens
    are added (as special, so decode(skip_special_tokens=True) drops them), as are the config's
    added_tokens_decoder entries (whose flags override tokenizer.json's)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    tok = Backend.from_file(str(path))
    padding = tok.padding
    # transformers' encode() switches off any truncation/padding saved in tokenizer.json
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))

    named: dict[str, Any] = {}
    for key in _SPECIAL_ATTRS:
        value = cfg.get(key, padding["pad_token"] if key == "pad_token" and padding else None)
        if _token_text(value) is not None:
            named[key] = value
    # model-specific named tokens (e.g. image_token) are special tokens too, in config order
    named.update({k: v for k, v in cfg.items() if k.endswith("_token") and k not in named
                  and k not in _SPECIAL_ATTRS and _token_text(v) is not None})
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: v for k, v in extra.items() if _token_text(v) is not None})
        extra = []

    def added_token(value: Any) -> Any:
        if isinstance(value, str):
            return AddedToken(value, special=True)
        return AddedToken(value["content"], **{k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value})

    decoder = cfg.get("added_tokens_decoder") or {}
    to_add = [added_token(decoder[i]) for i in sorted(decoder, key=int)]
    present = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    for is_named, value in [(True, v) for v in named.values()] + [(False, v) for v in extra]:
        token = added_token(value)
        if token.content in present:
            continue
        if is_named:
            token.special = True
        to_add.append(token)
        present.add(token.content)
    if to_add:
        tok.add_tokens(to_add)
    return tok, {k: str(_token_text(v)) for k, v in named.items()}


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (undoes WordPiece-style spaces before punctuation)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def _eos_ids(folder: Path, tokenizer_eos_id: int | None) -> set[int]:
    """EOS ids from generation_config.json (what HF generate stops on) and the tokenizer."""
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer_eos_id is not None:
        ids.add(tokenizer_eos_id)
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a small window (from a few tokens back to the end), so each call costs
    O(new tokens); holds text back while the window ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD), so it never emits half a character. The prompt's last tokens seed the
    window so that the first word's leading space comes out as the full decode would give it.
    Where the tokenizer allows, `tokenizers`' DecodeStream runs that window in Rust (one call a
    step); the window's offsets are kept here as well, for flush() and for the Python path, which
    hands the window back to a stream at the first emission that a stream can start from.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._streamable = True  # False once a stream failed or the text was flushed
        self._step = tokenizer.stream_decoder(self.ids, skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if self._step is not None:
            try:
                delta = self._step(new_ids)
            except Exception:  # noqa: BLE001 -- a decoder that rewrites earlier text: the Python window takes over
                self._step, self._streamable = None, False
            else:
                return "" if delta is None else self._emit(delta)
        prefix, full = self._window_texts()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        return self._emit(full[len(prefix):])

    def flush(self) -> str:
        """Release what is still held back when the stream ends, as the full decode shows it
        (U+FFFD for a truly incomplete character), so the streamed text equals decode(all ids)."""
        if self.read_offset >= len(self.ids):
            return ""
        self._step, self._streamable = None, False
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
        if self._step is None and self._streamable:
            self._step = self.tokenizer.stream_decoder(self.ids[self.prefix_offset:self.read_offset],
                                                       self.skip_special_tokens)
        self.text += delta
        return delta
