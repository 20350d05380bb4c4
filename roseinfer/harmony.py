"""gpt-oss's harmony format, read out of a reply's token ids: each message is a header (`<|start|>`
role, `<|channel|>` a channel, maybe ` to=functions.NAME` and `<|constrain|>json`), `<|message|>`,
its body, then `<|end|>`, `<|return|>` or `<|call|>`. The `analysis` channel is reasoning, `final`
the answer; a `commentary` message to `functions.NAME` is a tool call whose body is its JSON
arguments, and one to no one a preamble, shown as the answer is.

The markers are special tokens that decoding drops, so the parser reads ids, not text: it decodes
each body with an incremental detokenizer of its own, streaming reasoning and answer as they come;
a call is handed on whole when its message ends. Reasoning tokens are those of the analysis
messages' bodies and their end markers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roseinfer.reasoning_delta import ReasoningDelta, ReplySplitter

if TYPE_CHECKING:
    from roseinfer.tokenizer import IncrementalDetokenizer, Tokenizer

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN) + ENDS
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


@dataclass(frozen=True)
class HarmonyTokens:
    """The format a server reads (the reasoning parsers' `kind`) and its marker ids."""

    start_id: int
    channel_id: int
    message_id: int
    end_ids: tuple[int, ...]  # <|end|>, <|return|>, <|call|>
    marker_ids: tuple[int, ...]  # every marker's, in MARKERS' order
    kind: str = "harmony"

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyTokens | None:
        """The markers' ids, None unless each is one token of this tokenizer."""
        ids = {marker: tokenizer.encode(marker, add_special_tokens=False) for marker in MARKERS}
        if any(len(found) != 1 for found in ids.values()):
            return None
        return cls(ids[START][0], ids[CHANNEL][0], ids[MESSAGE][0], tuple(ids[end][0] for end in ENDS),
                   tuple(ids[marker][0] for marker in MARKERS))

    def answer_after_analysis(self) -> str:
        """Lark rules (llguidance's token syntax) for a reply of analysis messages, free but for the
        markers, then the final channel's message, whose body is the rule `answer`."""
        markers = ",".join(map(str, self.marker_ids))
        return (f'start: analysis* <[{self.channel_id}]> "final" <[{self.message_id}]> answer\n'
                f'analysis: <[{self.channel_id}]> "analysis" <[{self.message_id}]> <[^{markers}]>* '
                f'<[{self.end_ids[0]}]> <[{self.start_id}]> "assistant"\n')

    def parser(self, prompt_ids: list[int], tokenizer: Tokenizer) -> HarmonyParser:
        """A parser for one reply; the prompt ends with the header's start (`<|start|>assistant`)."""
        return HarmonyParser(self, tokenizer)


class HarmonyParser(ReplySplitter):
    """One reply's split, as the reasoning parsers' (reasoning.py ReasoningParser): `feed` each
    delta's token ids, `finish` at the end; `calls` holds the tool calls as (name, JSON arguments)."""

    mode = "start"  # the reply opens with a header, whose channel is yet to be read

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer) -> None:
        self.tags = tokens
        self.tokenizer = tokenizer
        self.reasoning = ""
        self.content = ""
        self.calls: list[tuple[str, str]] = []
        self.reasoning_tokens = 0
        self._header: list[int] = []  # the message header read so far (None once in a body)
        self._in_body = False
        self._channel = ""
        self._recipient: str | None = None
        self._body: IncrementalDetokenizer | None = None
        self._arguments = ""

    def feed(self, text: str, token_ids: list[int] = ()) -> ReasoningDelta:
        """text is not read: the markers it lost are in token_ids."""
        out = ReasoningDelta()
        for token in token_ids:
            if self._in_body:
                self._body_token(token, out)
            else:
                self._header_token(token)
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> ReasoningDelta:
        """The reply has ended: a body cut off is what it is; a header without a message that has no
        channel either is text from a model that does not write harmony, shown as the answer."""
        out = ReasoningDelta()
        if self._in_body:
            self._end_message(out)
        elif self._header and self.tags.channel_id not in self._header:
            out.content += self.tokenizer.decode(self._header)
        self._header = []
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _header_token(self, token: int) -> None:
        if token == self.tags.start_id or token in self.tags.end_ids:
            self._header = []
        elif token == self.tags.message_id:
            header = self.tokenizer.decode(self._header, skip_special_tokens=False)
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            self._channel = channel.group(1) if channel else ""
            self._recipient = recipient.group(1) if recipient else None
            self._start_body()
        else:
            self._header.append(token)

    def _start_body(self) -> None:
        from roseinfer.tokenizer import IncrementalDetokenizer

        self._in_body, self._header, self._arguments = True, [], ""
        self._body = IncrementalDetokenizer(self.tokenizer, [])

    def _body_token(self, token: int, out: ReasoningDelta) -> None:
        if self._channel == "analysis":
            self.reasoning_tokens += 1
        if token in self.tags.end_ids:
            self._end_message(out)
            return
        self._route(self._body.add([token]), out)

    def _end_message(self, out: ReasoningDelta) -> None:
        self._route(self._body.flush(), out)
        if self._recipient is not None:
            self.calls.append((self._recipient, self._arguments.strip()))
            out.calls.append(self.calls[-1])
        self._in_body, self._body = False, None

    def _route(self, text: str, out: ReasoningDelta) -> None:
        if self._recipient is not None:
            self._arguments += text
        elif self._channel == "analysis":
            out.reasoning += text
        else:  # final, or a commentary preamble
            out.content += text
