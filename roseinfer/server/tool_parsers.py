"""Tool calls out of generated text, whole or streamed, in the formats models are trained on.

Every parser is a small state machine fed text deltas: `feed` returns the content that is safe to
show and OpenAI's `delta.tool_calls` entries, `finish` ends the text. A call is emitted once it is
complete and parses (its header, then its arguments), so a stream gives the same content and calls
as the whole text, however the text was split, and malformed calls stay content. Text that may be
the start of a call marker is held back, so no part of a call leaks as content. Whitespace next to
a call is dropped: it separates calls, it is not something the model said.

- hermes (Hermes, Qwen2.5/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any
  number, text around them.
- llama3_json (Llama 3.1+): the output starts with `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`.
- harmony (gpt-oss): calls come on the commentary channel, which the harmony reasoning parser
  (roseinfer/harmony.py) reads out of the token ids and hands on whole (`called`); the text it
  passes on is all answer.
- required / named: the output constrained by tool_choice (server/tool_calls.py): a JSON array of
  `{"name", "parameters"}` objects, or the named function's arguments themselves, which the
  constraint keeps valid and so are streamed as they come.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from roseinfer.stop_strings import held_length

PARSERS = ("hermes", "llama3_json", "harmony")
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's delta.tool_calls entries

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ToolParser(ABC):
    """Base: what every parser records (all content, all calls) and how it emits them."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls false: 1; later calls are dropped
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text fed but not yet resolved
        self._after_call = False  # whitespace after a call is dropped

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of output: what of it can be shown and which calls it completed."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The output has ended: whatever was held back, resolved."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: its content (None when there is none besides whitespace) and its calls."""
        self.feed(text)
        self.finish()
        return (self.content if self.content.strip() else None), self.calls

    def called(self, name: str, arguments: str) -> ParsedDelta:
        """A call another parser found whole (harmony's commentary channel)."""
        out = ParsedDelta()
        self._call(name, arguments, out)
        return out

    def _text(self, text: str, out: ParsedDelta) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        self.content += text
        out.content += text

    def _call(self, name: str, arguments: str, out: ParsedDelta) -> None:
        self._after_call = True
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        call = ToolCall(name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        out.tool_calls.append({"index": index, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
        if arguments:
            out.tool_calls.append({"index": index, "function": {"arguments": arguments}})


def call_from_json(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from `{"name": ..., "arguments" or "parameters": {...}}`;
    None if it is not such an object. Arguments sent as a JSON string are taken as that JSON."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass
class JsonScan:
    """Finds where the JSON object or array at the start of a growing text closes, resuming where
    the last look stopped, so a long call streamed in many deltas is scanned once, not per delta.
    Brackets inside strings do not count."""

    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """The index after the closing bracket, or None while the value is still open."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._in_call = False
        self._space_before = ""  # whitespace dropped before the open call: content again if it is malformed

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Resolve what the buffer allows; True if there may be more."""
        buf = self._buffer
        if self._in_call:
            end = buf.find(self.END)
            if end < 0:
                return False
            self._close(buf[len(self.START):end], buf[:end + len(self.END)], out)
            self._buffer = buf[end + len(self.END):]
            return True
        start = buf.find(self.START)
        if start < 0:
            # hold back a possible marker start and the whitespace before it
            cut = len(buf[:len(buf) - held_length(buf, [self.START])].rstrip())
            self._text(buf[:cut], out)
            self._buffer = buf[cut:]
            return False
        before = buf[:start].rstrip()
        self._text(before, out)
        self._space_before, self._buffer, self._in_call = buf[len(before):start], buf[start:], True
        return True

    def _close(self, body: str, raw: str, out: ParsedDelta) -> None:
        self._in_call = False
        call = call_from_json(body)
        if call is None:
            self._text(self._space_before + raw, out)
        else:
            self._call(*call, out)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:  # no closing tag: the call counts if what follows the opening one parses
            self._close(self._buffer[len(self.START):], self._buffer, out)
        else:
            self._text(self._buffer, out)
        self._buffer = ""
        return out


class JsonCallsParser(ToolParser):
    """A run of JSON call objects at the start of the output, `sep`-separated, optionally inside
    `opener`...`closer`. What follows the last call that parses is content; if the first object is
    not a call, the whole output is content."""

    def __init__(self, sep: str, opener: str = "", closer: str = "", prefix: str = "",
                 max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.sep, self.opener, self.closer, self.prefix = sep, opener, closer, prefix
        self._mode = "start"  # start -> calls -> text, or start -> text
        self._opened = not opener
        self._raw = ""  # all text while no call has been found: content if none will be
        self._scan = JsonScan()  # of the object the buffer starts with

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "text":
            self._text(text, out)
            return out
        self._buffer += text
        if not self.calls:
            self._raw += text
        if self._mode == "start":
            head = self._buffer.lstrip()
            if self.prefix and head.startswith(self.prefix):
                head = head[len(self.prefix):].lstrip()
            if not head or (self.prefix and self.prefix.startswith(head)):
                return out  # not yet known
            if not head.startswith(self.opener or "{"):
                return self._to_text(out)
            self._mode, self._buffer = "calls", head
        while self._next_call(out):
            pass
        return out

    def _next_call(self, out: ParsedDelta) -> bool:
        buf = self._buffer.lstrip()
        if not self._opened:
            if not buf.startswith(self.opener):
                return False
            buf, self._opened = buf[len(self.opener):], True
        buf = buf.lstrip(self.sep + " \t\r\n")
        self._buffer = buf
        if not buf or (self.closer and buf.startswith(self.closer)):
            return False
        if buf[0] != "{":
            self._to_text(out)
            return False
        end = self._scan.end(buf)
        if end is None:
            return False
        call = call_from_json(buf[:end])
        if call is None:
            self._to_text(out)
            return False
        self._call(*call, out)
        self._buffer, self._scan = buf[end:], JsonScan()
        return True

    def _to_text(self, out: ParsedDelta) -> ParsedDelta:
        """What is left is content: everything, if no call was found."""
        self._mode = "text"
        rest, self._buffer = (self._buffer if self.calls else self._raw), ""
        if self.closer and self.calls and rest.lstrip().startswith(self.closer):
            rest = rest.lstrip()[len(self.closer):]
        self._text(rest, out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode != "text" and (self._buffer.strip() or not self.calls):
            self._to_text(out)
        return out


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the whole output is its arguments (constrained to its schema),
    streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self.calls:
            self._call(self.name, "", out)
        if text:
            self.calls[0].arguments += text
            out.tool_calls.append({"index": 0, "function": {"arguments": text}})
        return out

    def finish(self) -> ParsedDelta:
        return self.feed("") if not self.calls else ParsedDelta()


class ChannelCallParser(ToolParser):
    """harmony: the text is all answer; the calls arrive through `called`."""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._text(text, out)
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


def make_parser(kind: str, max_calls: int | None = None) -> ToolParser:
    """A parser for free output ("hermes", "llama3_json") or for tool_choice "required" output."""
    if kind == "hermes":
        return HermesParser(max_calls)
    if kind == "llama3_json":
        return JsonCallsParser(";", prefix=PYTHON_TAG, max_calls=max_calls)
    if kind == "harmony":
        return ChannelCallParser(max_calls)
    if kind == "required":
        return JsonCallsParser(",", opener="[", closer="]", max_calls=max_calls)
    raise ValueError(f"unknown tool-call parser {kind!r} (choose from {', '.join(PARSERS)})")


def format_calls(kind: str, calls: list[dict[str, Any]]) -> str:
    """Earlier calls written back in the parser's format, for templates that cannot render
    tool_calls themselves; each call is {"name", "arguments": dict}."""
    if kind == "llama3_json":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)
    return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
