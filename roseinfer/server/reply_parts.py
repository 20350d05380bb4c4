"""A reply split into its parts: the reasoning a parser takes off the front, the answer, and the
tool calls in the answer; whole (split_reply) or a streamed delta at a time (split_delta)."""
from __future__ import annotations

from typing import Any

from roseinfer.output_processor import StreamDelta
from roseinfer.reasoning import Reasoner
from roseinfer.server.tool_parsers import NamedCallParser, ToolCall, ToolParser


def split_reply(text: str, token_ids: list[int], reasoner: Reasoner | None,
                parser: ToolParser | None) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole reply's (reasoning, answer, tool calls): the reasoning split off first, then the
    answer's calls (the reasoning may mention calls it did not make)."""
    reasoning = None
    if reasoner is not None:
        reasoning, text = reasoner.parse(text, token_ids)
    if parser is None:
        return reasoning, text, []
    for name, arguments in reasoner.calls if reasoner is not None else ():  # harmony's, read from the ids
        parser.called(name, arguments)
    content, calls = parser.parse(text or "")
    return reasoning, content, calls


def split_delta(delta: StreamDelta, reasoner: Reasoner | None,
                parser: ToolParser | None) -> tuple[str, str, list[dict[str, Any]]]:
    """A streamed delta's (reasoning, answer text, OpenAI delta.tool_calls entries), as split_reply
    splits a whole reply; the parsers' held-back text comes out with the final delta."""
    reasoning, content, calls = "", delta.text, []
    if reasoner is not None:
        split = reasoner.feed(delta.text, delta.token_ids)
        if delta.finished:
            split.extend(reasoner.finish())
        reasoning, content = split.reasoning, split.content
    if parser is not None:
        parsed = parser.feed(content)
        for name, arguments in split.calls if reasoner is not None else ():  # harmony's, read from the ids
            parsed.extend(parser.called(name, arguments))
        if delta.finished:
            parsed.extend(parser.finish())
        content, calls = parsed.content, parsed.tool_calls
    return reasoning, content, calls


def finish_reason(reason: str | None, parser: ToolParser | None) -> str | None:
    """OpenAI's "tool_calls" when the output ended by itself with calls the model chose to make; a
    call forced by naming its function ends with "stop", as OpenAI's and vLLM's do."""
    chose = parser is not None and parser.calls and not isinstance(parser, NamedCallParser)
    return "tool_calls" if reason == "stop" and chose else reason
