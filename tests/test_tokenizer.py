"""IncrementalDetokenizer: streamed deltas add up to the full decode and never split a character;
Tokenizer: the same ids, text and chat prompts as transformers.AutoTokenizer, without importing it."""
from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from roseinfer.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Héllo wörld — naïve café 你好世界 🙂🚀 done."


def test_streamed_text_equals_full_decode_and_never_emits_half_a_character(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    prompt = tok.encode("Say:")
    ids = tok.encode(" " + TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # byte-level pieces: many characters span several tokens
    assert tok.stream_decoder(prompt) is not None  # tokenizers' DecodeStream runs the window
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""


def test_a_failing_decode_stream_hands_its_window_to_the_python_path(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(" " + TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    deltas = [detok.add([i]) for i in ids[:7]]

    def invalid_prefix(new_ids: list[int]) -> str | None:  # what DecodeStream raises when a decoder rewrites text
        raise RuntimeError("Invalid prefix encountered")

    detok._step = invalid_prefix
    deltas += [detok.add([i]) for i in ids[7:]] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_a_prompt_ending_inside_a_character_starts_on_the_python_window(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    emoji = tok.encode("🙂", add_special_tokens=False)
    prompt = tok.encode("Say:") + emoji[:1]
    assert tok.stream_decoder(prompt) is None  # DecodeStream would emit the prompt's text with the first delta
    rest = emoji[1:] + tok.encode(" " + TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in rest]
    assert detok._step is not None  # the window went back to a stream at its first emission
    deltas.append(detok.flush())
    context = prompt[-IncrementalDetokenizer.CONTEXT:]
    assert "".join(deltas) == tok.decode(context + rest)[len(tok.decode(context)):]


def test_flush_releases_a_truly_incomplete_tail(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:1]) == ""  # held back: half an emoji
    assert detok.flush() == tok.decode(ids[:1])  # the end of the stream shows what decode shows


# --------------------------------------------------------------------------- parity with transformers
# The runtime Tokenizer reads tokenizer.json with the `tokenizers` library and renders chat
# templates itself; everything below must equal transformers.AutoTokenizer on the same folder.


STRINGS = [
    "Hello, world!",
    "   three leading spaces, two trailing  ",
    " " + TEXT,
    "tabs\tand\r\nnewlines\n\n\nend",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<|endoftext|>b <|im_end|> c<|im_start|>",
    "<|im_end",  # almost a special token
    "<mask> <|tool|> <|note|>",  # special and plain tokens added by some configs below
    "def add(a, b):\n    return a + b  # $42.50 (x=[1, 2])",
    "",
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello 🙂 how can I help?"},
     {"role": "user", "content": "Où est la gare ? 你好"}],
    [{"role": "user", "content": "  spaced  <|im_end|> text "}],
]


@functools.lru_cache(maxsize=None)
def _hf(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    from roseinfer.loader.model_loader import resolve_model_folder

    return resolve_model_folder(None)  # the embedded default model (converted once, then cached)


@pytest.fixture(params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def folder(request: pytest.FixtureRequest, tokenizer_dir: Path) -> Path:
    return tokenizer_dir if request.param == "tiny" else request.getfixturevalue("default_model_dir")


def _assert_same(folder: Path, conversations: list[list[dict[str, Any]]] = CONVERSATIONS) -> None:
    tok, hf = Tokenizer(folder), _hf(str(folder))
    for text in STRINGS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == list(hf.encode(text, add_special_tokens=add)), text
    n = len(hf)
    sequences = [list(hf.encode(t)) for t in STRINGS] + [list(range(min(n, 64))), list(range(n - 20, n))]
    for ids in sequences:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert tok.vocab_size == n
    assert tok.special_tokens == hf.special_tokens_map  # bos/eos/unk/pad/... by name
    for token in hf.all_special_tokens:
        assert tok.token_to_id(token) == hf.convert_tokens_to_ids(token)
        assert tok.id_to_token(tok.token_to_id(token)) == token
    gen = folder / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else (gen_eos or [])
    assert tok.eos_token_ids == {*gen_eos, hf.eos_token_id}
    assert tok.has_chat_template
    for messages in conversations:
        # extra keyword arguments are template variables in both (TRICKY_TEMPLATE reads this one)
        for gen_prompt, kwargs in ((True, {}), (False, {}), (True, {"enable_thinking": False})):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt, **kwargs)
            assert tok.render_chat_template(messages, add_generation_prompt=gen_prompt, **kwargs) == text
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen_prompt, return_dict=False, **kwargs)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, **kwargs) == list(ids)


def test_matches_transformers(folder: Path):
    _assert_same(folder)


# Exercises what a real template may use: special-token variables, tojson, loop controls,
# namespace, raise_exception and transformers' {% generation %} tag.
TRICKY_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }} {{ image_token }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}|{{ m['thinking'] }}</think>{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m.get('content', 'NONE') }}{% endgeneration %}"
    "{% else %}{{ m['content'] | tojson }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{{ ns.n }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)
TRICKY_CONVERSATIONS = CONVERSATIONS + [
    [{"role": "user", "content": "x"}, {"role": "skip", "content": "y"},
     {"role": "assistant", "content": None, "reasoning_content": "hmm"},
     {"role": "user", "content": "quote \" <b>é</b>"}],
]


def _tricky_folder(src: Path, dst: Path, variant: str) -> Path:
    """The tiny tokenizer with a config in the older, richer formats: AddedToken dicts, extra and
    model-specific special tokens that are not in tokenizer.json yet, a list of named templates;
    plus (by variant) a chat_template.jinja, a transformers-4 added_tokens_decoder, or a legacy
    special_tokens_map.json."""
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update({
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "mask_token": {"__type": "AddedToken", "content": "<mask>", "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False, "special": False},  # named: made special
        "image_token": "<|image|>",
        "additional_special_tokens": ["<|tool|>"],
        "chat_template": [{"name": "default", "template": TRICKY_TEMPLATE}, {"name": "other", "template": "x"}],
    })
    if variant == "decoder":  # flags here override tokenizer.json's; a new plain token comes first
        flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
        cfg["added_tokens_decoder"] = {
            "0": {"content": "<|endoftext|>", **flags, "special": True},
            "1": {"content": "<|im_start|>", **flags, "special": False},
            "2": {"content": "<|im_end|>", **flags, "special": True},
            "384": {"content": "<|note|>", **flags, "special": False},
        }
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if variant == "jinja":  # transformers 5's own format; the file wins over the config's template
        (dst / "chat_template.jinja").write_text(TRICKY_TEMPLATE.replace("<think>", "<reason>"))
    if variant in ("legacy_map", "decoder"):  # read only when there is no added_tokens_decoder
        (dst / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    return dst


@pytest.mark.parametrize("variant", ["config", "jinja", "decoder", "legacy_map"])
def test_matches_transformers_on_older_config_formats(tokenizer_dir: Path, tmp_path: Path, variant: str):
    folder = _tricky_folder(tokenizer_dir, tmp_path / "tok", variant)
    _assert_same(folder, TRICKY_CONVERSATIONS)
    tok = Tokenizer(folder)
    # <mask>, <|image|>, <|tool|> (and <|note|>) were added, as transformers does
    assert tok.vocab_size == 384 + 3 + (variant == "decoder")
    assert tok.special_tokens["pad_token"] == ("<|endoftext|>" if variant == "legacy_map" else "<|im_end|>")
    assert tok.decode(tok.encode("a<|tool|>b<mask>")) == "ab"  # ... as special tokens
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_building_a_tokenizer_does_not_import_transformers(tokenizer_dir: Path):
    code = ("import sys; from roseinfer.tokenizer import Tokenizer; "
            f"t = Tokenizer({str(tokenizer_dir)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}]); "
            "t.decode(t.encode('hi')); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_chat_template_raises_value_error(tokenizer_dir: Path, tmp_path: Path):
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="this model has no chat template; send a plain prompt instead"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hi") == list(_hf(str(tmp_path)).encode("hi"))


def test_folder_without_tokenizer_json_falls_back_to_transformers(tokenizer_dir: Path, tmp_path: Path):
    """A vocab.json + merges.txt folder (as sentencepiece-only ones, it has no tokenizer.json)
    loads through AutoTokenizer behind the same API, and tokenizes like the tokenizer.json."""
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(tj["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    _assert_same(tmp_path)
    fallback, fast = Tokenizer(tmp_path), Tokenizer(tokenizer_dir)
    assert fallback._hf is not None and fast._hf is None
    for text in STRINGS:
        assert fallback.encode(text) == fast.encode(text)
    assert fallback.apply_chat_template(CONVERSATIONS[1]) == fast.apply_chat_template(CONVERSATIONS[1])
