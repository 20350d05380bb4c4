"""What a reasoning parser hands on for each piece of a reply (reasoning.py's, harmony.py's), and
the whole-reply form both parsers share."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON arguments): harmony's tool calls

    def extend(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ReplySplitter(ABC):
    """A reply's split fed a delta at a time; `reasoning` and `content` accumulate what was handed on."""

    reasoning: str
    content: str

    @abstractmethod
    def feed(self, text: str, token_ids: list[int] = ()) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...

    def parse(self, text: str, token_ids: list[int] = ()) -> tuple[str | None, str | None]:
        """A whole reply: its reasoning and its content, None where there is none."""
        self.feed(text, token_ids)
        self.finish()
        return self.reasoning or None, self.content or None
