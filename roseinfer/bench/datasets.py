"""Prompt sources for ``bench serve``.

* ``random``: prompts of random common words, about ``input_len`` tokens each.
* ``shared-prefix``: one long "system prompt" shared by every request, then a distinct
  short question, to exercise prefix caching.
* a JSONL file (``--dataset-path``): one object per line with a "prompt" field and an
  optional "output_len".

Without a tokenizer a prompt is sized in words: the vocabulary below is short, common
English words, each of which is a single token (with its leading space) in the usual
BPE vocabularies, so word count ~= token count. With a tokenizer-like object (anything
with ``encode(str) -> list[int]``) prompts are sized by real token counts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

DATASETS: tuple[str, ...] = ("random", "shared-prefix")

# Short, frequent words: one BPE token each in GPT-2/Llama/Qwen-style vocabularies.
_WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on are with as be at by this had not but from or have
    an they which one you were all we her she there would their will when who him been
    has more if no out do so can what up said about other into than its time only could
    new them man some these then two first may any like now my such make over our even
    most me state after also made many did must before back see through way where get
    much go well your know should down work year because come people just say each
    those take day good how long very own under last right part world never great old
    same use small life house every found still place city water light night hand line
    open start end green blue red stone river tree music paper table road""".split()
)


class Tokenizer(Protocol):
    """The one method we need; ``decode`` is used too when the object has it."""

    def encode(self, text: str) -> list[int]: ...


@dataclass
class BenchRequest:
    """One benchmark request: the prompt text and how many tokens to ask for.
    ``prompt_len`` is the prompt's size in tokens as far as we know it (exact with a
    tokenizer, a word count without); it is only a fallback when the server's usage
    record does not report prompt tokens."""

    prompt: str
    output_len: int
    prompt_len: int | None = None


def scaled_len(length: int, range_ratio: float, rng: np.random.Generator) -> int:
    """A length drawn uniformly from [length*(1-r), length*(1+r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(length * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(length * (1.0 + range_ratio)))
    return int(rng.integers(lo, hi + 1))


def _count(text: str, tokenizer: Tokenizer | None) -> int:
    return len(tokenizer.encode(text)) if tokenizer is not None else len(text.split())


def _fit(words: list[str], target: int, tokenizer: Tokenizer | None) -> tuple[str, int]:
    """Join a prefix of ``words`` holding as close to ``target`` tokens as possible
    (never more when the tokenizer allows it); returns (text, token count)."""
    if tokenizer is None:
        return " ".join(words[:target]), min(target, len(words))
    # Token count grows with the number of words, so binary-search the largest prefix
    # that fits; this costs O(log n) encodes instead of one per word.
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(" ".join(words[:mid]), tokenizer) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    count = _count(text, tokenizer)
    decode = getattr(tokenizer, "decode", None)
    if count < target and callable(decode):
        # Word granularity may leave us a token or two short: cut the token ids of a
        # longer text instead, and keep it if it survives a decode/encode round trip.
        ids = tokenizer.encode(" ".join(words[: lo + 2]))[:target]
        candidate = decode(ids)
        if _count(candidate, tokenizer) == target:
            return candidate, target
    return text, count


def _random_words(rng: np.random.Generator, n: int) -> list[str]:
    idx = rng.integers(0, len(_WORDS), size=n)
    return [_WORDS[i] for i in idx]


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> list[BenchRequest]:
    """``num`` prompts of random words, each ~input_len tokens, asking for ~output_len."""
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    for _ in range(num):
        in_len = scaled_len(input_len, range_ratio, rng)
        out_len = scaled_len(output_len, range_ratio, rng)
        # A few spare words so a tokenizer that merges some words still reaches in_len.
        words = _random_words(rng, in_len + max(4, in_len // 4))
        text, count = _fit(words, in_len, tokenizer)
        out.append(BenchRequest(prompt=text, output_len=out_len, prompt_len=count))
    return out


def shared_prefix_requests(
    num: int,
    prefix_len: int,
    output_len: int,
    question_len: int = 32,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """~prefix_len-token system prompts (num_prefixes of them, request i takes number i mod
    num_prefixes), each followed by a distinct question. Several prefixes tell a router that keeps
    a prefix on one replica from one that scatters it."""
    if prefix_len < 1 or output_len < 1 or question_len < 1 or num_prefixes < 1:
        raise ValueError("prefix_len, question_len, output_len and num_prefixes must be >= 1")
    rng = np.random.default_rng(seed)
    systems = []
    for _ in range(num_prefixes):
        body, _ = _fit(_random_words(rng, prefix_len + max(4, prefix_len // 4)), prefix_len, tokenizer)
        systems.append(f"You are a helpful assistant. Reference notes: {body}\n\n")
    out: list[BenchRequest] = []
    for i in range(num):
        # The index makes every question distinct even if two draws of words collide.
        question = f"Question {i}: " + " ".join(_random_words(rng, question_len)) + "?"
        prompt = systems[i % num_prefixes] + question
        out.append(BenchRequest(prompt=prompt, output_len=output_len, prompt_len=_count(prompt, tokenizer)))
    return out


def jsonl_requests(
    path: str | Path,
    num: int | None,
    default_output_len: int,
    tokenizer: Tokenizer | None = None,
) -> list[BenchRequest]:
    """Requests from a JSONL file. With ``num`` larger than the file, lines are reused
    in order so that the benchmark still sends ``num`` requests."""
    items: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a string "prompt"')
            out_len = obj.get("output_len", default_output_len)
            if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
                raise ValueError(f'{path}:{lineno}: "output_len" must be a positive integer')
            prompt = obj["prompt"]
            items.append(BenchRequest(prompt=prompt, output_len=out_len, prompt_len=_count(prompt, tokenizer)))
    if not items:
        raise ValueError(f"{path}: no prompts found")
    if num is None:
        return items
    return [items[i % len(items)] for i in range(num)]


def load_requests(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    dataset_path: str | Path | None = None,
    tokenizer: Tokenizer | None = None,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """Dispatch on the CLI's --dataset / --dataset-path (a path wins over the name)."""
    if dataset_path is not None:
        return jsonl_requests(dataset_path, num_prompts, output_len, tokenizer)
    if dataset == "random":
        return random_requests(num_prompts, input_len, output_len, range_ratio, seed, tokenizer)
    if dataset == "shared-prefix":
        return shared_prefix_requests(num_prompts, input_len, output_len, seed=seed, tokenizer=tokenizer,
                                      num_prefixes=num_prefixes)
    raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")

