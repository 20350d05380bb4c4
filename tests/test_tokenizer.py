"""IncrementalDetokenizer: streamed deltas add up to the full decode and never split a character."""
from __future__ import annotations

from roseinfer.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Héllo wörld — naïve café 你好世界 🙂🚀 done."


def test_streamed_text_equals_full_decode_and_never_emits_half_a_character(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    prompt = tok.encode("Say:")
    ids = tok.encode(" " + TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # byte-level pieces: many characters span several tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""


def test_flush_releases_a_truly_incomplete_tail(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:1]) == ""  # held back: half an emoji
    assert detok.flush() == tok.decode(ids[:1])  # the end of the stream shows what decode shows
