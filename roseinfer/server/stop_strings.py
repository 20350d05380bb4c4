"""OpenAI `stop` strings, matched on streamed text without ever emitting any part of a match."""
from __future__ import annotations

from dataclasses import dataclass


def held_length(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: text
    that must be held back from a stream until the next delta says whether a marker begins there."""
    for k in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


@dataclass
class StopStringMatcher:
    """Feeds on text deltas; returns the part that is safe to show.

    Text is held back while its tail could still be the start of a stop string; once a stop
    string appears, everything from its first character on is dropped. Only the unsent tail is
    kept, so a step costs O(delta + longest stop string), not O(output).
    """

    stops: list[str]
    pending: str = ""  # text received but not yet released

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise ValueError("stop strings must not be empty")

    def add(self, delta: str) -> tuple[str, bool]:
        """Append `delta`; return (text to release now, whether a stop string matched).

        A match cannot start in text already released: that text was released only because no
        suffix of it could begin a stop string. So searching the pending tail is enough.
        """
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        hold = held_length(text, self.stops)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The request ended without a match: the held-back tail is ordinary text after all."""
        text, self.pending = self.pending, ""
        return text
