"""Reasoning apart from the answer: `<think>…</think>` in a chat reply, as thinking models write it.

A parser is fed the reply's text deltas and splits them into reasoning and content, streamed or
whole, however the tags were split across deltas: text that may be the start of a tag is held
back until the next delta says. Only the first `<think>…</think>` counts; whitespace next to the
tags is dropped (it separates the parts, it is not something the model said).

Where the reply starts depends on the rendered prompt, read from its last characters: a prompt
ending with `<think>` (DeepSeek-R1's template, Qwen3-Thinking-2507's) starts the reply inside the
reasoning; one ending with `</think>` (Qwen3's with enable_thinking false) has no reasoning to
come; otherwise the reply may open with `<think>` (Qwen3), and without it it is all answer for
`qwen3` and all reasoning up to `</think>` for `deepseek_r1` (older R1 distills skip the tag).

The tags must be single tokens that the detokenizer keeps (added tokens that are not special, as
in Qwen3's and DeepSeek-R1's tokenizers): the text is split on them, and reasoning tokens (usage)
are counted on their ids. An output constraint is put after the reasoning by a grammar over those
ids (after_reasoning), so it constrains the answer only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from roseinfer.harmony import CHANNEL, HarmonyTokens
from roseinfer.reasoning_delta import ReasoningDelta, ReplySplitter
from roseinfer.sampling_params import StructuredOutputsParams
from roseinfer.stop_strings import held_length

if TYPE_CHECKING:  # `roseinfer serve --help` builds its flags from this module without loading tokenizers
    from roseinfer.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "harmony")
PROMPT_TAIL_TOKENS = 8  # enough to see the generation prompt's last tag past trailing newlines
Mode = Literal["start", "reasoning", "content"]


@dataclass(frozen=True)
class ThinkTags:
    """The reasoning format a server reads, and the ids of its tags."""

    kind: str  # one of REASONING_PARSERS
    start_id: int
    end_id: int

    def parser(self, prompt_ids: list[int], tokenizer: Tokenizer) -> ReasoningParser:
        """A parser for one reply to this prompt, starting where the prompt leaves the reply."""
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
        if tail.endswith(THINK_START):
            return ReasoningParser(self, "reasoning", "reasoning")
        if tail.endswith(THINK_END):
            return ReasoningParser(self, "content", "content")
        return ReasoningParser(self, "start", "reasoning" if self.kind == "deepseek_r1" else "content")


def after_reasoning(params: StructuredOutputsParams, tags: ThinkTags | HarmonyTokens, mode: Mode,
                    json_whitespace: str) -> StructuredOutputsParams:
    """The constraint on the answer alone, for a reply that starts in `mode` (not "content"): a Lark
    grammar that lets any tokens but `</think>` through, then `</think>`, then the answer (for qwen3,
    a reply that does not open with `<think>` is all answer, as the parser reads it; for harmony,
    analysis messages, then the final channel's). A ValueError for regex and grammar constraints,
    which cannot be put inside another grammar as they are."""
    if params.regex is not None or params.grammar is not None:
        raise ValueError(f"a {params.kind} constraint cannot be put after the reasoning yet")
    if params.choice is not None:
        answer = " | ".join(json.dumps(c) for c in params.choice)  # JSON string literals are Lark's
    else:
        schema = params.json if params.json is not None else {"type": "object"}
        # the server's whitespace rule between JSON tokens, unless the schema sets its own
        options = {"whitespace_pattern": json_whitespace, **schema.get("x-guidance", {})}
        answer = "%json " + json.dumps({**schema, "x-guidance": options})
    if tags.kind == "harmony":
        return StructuredOutputsParams(grammar=tags.answer_after_analysis() + f"answer: {answer}\n")
    reasoning = f"<[^{tags.end_id}]>* <[{tags.end_id}]> answer"  # a leading <think> included
    if mode == "start" and tags.kind == "qwen3":  # its reply thinks only if it opens with <think>
        reasoning = f"<[{tags.start_id}]> {reasoning} | answer"
    return StructuredOutputsParams(grammar=f"start: {reasoning}\nanswer: {answer}\n")


def pick_reasoning_parser(template: str | None, flag: str,
                          tokenizer: Tokenizer) -> ThinkTags | HarmonyTokens | None:
    """--reasoning-parser: a name, "none", or "auto": harmony (roseinfer/harmony.py) when the chat
    template writes `<|channel|>` and the tokenizer has harmony's markers; qwen3 when it writes
    `</think>` (thinking templates do, to drop earlier turns' reasoning or to close it when thinking
    is off) and the tokenizer has the tags as kept tokens; no parser otherwise."""
    if flag == "none":
        return None
    if flag in ("auto", "harmony") and (flag == "harmony" or CHANNEL in (template or "")):
        harmony = HarmonyTokens.of(tokenizer)
        if harmony is None and flag == "harmony":
            raise ValueError("--reasoning-parser harmony needs harmony's markers (<|channel|>, <|message|>, ...) "
                             "as single tokens of this tokenizer")
        if harmony is not None:
            return harmony
    ids = [_tag_id(tokenizer, tag) for tag in (THINK_START, THINK_END)]
    if flag == "auto":
        if THINK_END not in (template or "") or None in ids:
            return None
        flag = "qwen3"
    if flag not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be auto, none or one of {', '.join(REASONING_PARSERS)}")
    if None in ids:
        raise ValueError(f"--reasoning-parser {flag} needs {THINK_START} and {THINK_END} as tokens of this tokenizer "
                         "that decoding keeps (added, not special)")
    return ThinkTags(flag, *ids)


def _tag_id(tokenizer: Tokenizer, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == tag else None


class Reasoner(Protocol):
    """What the server reads of one reply's reasoning parser: ReasoningParser, or harmony.py's
    HarmonyParser (which also finds tool calls)."""

    tags: ThinkTags | HarmonyTokens
    mode: Mode
    reasoning: str
    content: str
    calls: list[tuple[str, str]]

    @property
    def reasoning_tokens(self) -> int: ...

    def feed(self, text: str, token_ids: list[int] = ()) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...

    def parse(self, text: str, token_ids: list[int] = ()) -> tuple[str | None, str | None]: ...


class ReasoningParser(ReplySplitter):
    """One reply's split: `feed` each text delta (and its token ids), `finish` at the end."""

    def __init__(self, tags: ThinkTags, mode: Mode, default: Mode) -> None:
        self.tags = tags
        self.mode = mode
        self.default = default  # the mode a reply that does not open with <think> is in
        self.reasoning = ""  # all of it so far, for a non-streamed reply
        self.content = ""
        self.calls: list[tuple[str, str]] = []  # none: <think> replies make calls in their answer
        self.had_reasoning = mode == "reasoning"
        self._pending = ""  # text held back: maybe the start of a tag, or whitespace before one
        self._strip_leading = mode == "reasoning"  # whitespace right after a tag is dropped
        self._counted = 0  # tokens before </think>, less a leading <think>
        self._tokens_seen = 0
        self._count_done = mode == "content"

    @property
    def reasoning_tokens(self) -> int:
        return self._counted if self.had_reasoning else 0

    def feed(self, text: str, token_ids: list[int] = ()) -> ReasoningDelta:
        self._count(token_ids)
        out = ReasoningDelta()
        text = self._pending + text
        self._pending = ""
        while text:
            text = getattr(self, f"_{self.mode}")(text, out)
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> ReasoningDelta:
        """The reply has ended: held-back text is what it is after all (a cut-off tag included)."""
        if self.mode == "start":
            self._enter(self.default)
        text, self._pending = self._pending, ""
        if self._strip_leading:
            text = text.lstrip()
        # held whitespace before a </think> that never came ends the reasoning: dropped
        out = ReasoningDelta(reasoning=text.rstrip()) if self.mode == "reasoning" else ReasoningDelta(content=text)
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _start(self, text: str, out: ReasoningDelta) -> str:
        """Before anything but whitespace: a <think> opens the reasoning, anything else is the default."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            self._enter("reasoning")
            return stripped[len(THINK_START):]
        if THINK_START.startswith(stripped):  # empty, or maybe the tag's start
            self._pending = text
            return ""
        self._enter(self.default)
        return text

    def _reasoning(self, text: str, out: ReasoningDelta) -> str:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        end = text.find(THINK_END)
        if end >= 0:
            out.reasoning += text[:end].rstrip()
            self._enter("content")
            return text[end + len(THINK_END):]
        release = text[:len(text) - held_length(text, [THINK_END])]
        release = release.rstrip()  # whitespace before a </think> is held until the tag is ruled out
        out.reasoning += release
        self._pending = text[len(release):]
        return ""

    def _content(self, text: str, out: ReasoningDelta) -> str:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        out.content += text
        return ""

    def _enter(self, mode: Mode) -> None:
        self._strip_leading = mode == "reasoning" or self.mode == "reasoning"
        self.had_reasoning |= mode == "reasoning"
        self.mode = mode

    def _count(self, token_ids: list[int]) -> None:
        for token in token_ids:
            first = self._tokens_seen == 0
            self._tokens_seen += 1
            if self._count_done or (first and token == self.tags.start_id):
                continue
            if token == self.tags.end_id:
                self._count_done = True
            else:
                self._counted += 1
