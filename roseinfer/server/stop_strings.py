"""OpenAI `stop` strings, matched on streamed text without ever emitting any part of a match."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopStringMatcher:
    """Feeds on text deltas; returns the part that is safe to show.

    Text is held back while its tail could still be the start of a stop string; once a stop
    string appears, everything from its first character on is dropped. Only the unsent tail is
    kept, so a step costs O(delta + longest stop string), not O(output).
    """

    stops: list[str]
    pending: str = ""  # text received but not yet released
    _max_hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise ValueError("stop strings must not be empty")
        self._max_hold = max(len(s) for s in self.stops) - 1

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
        hold = self._held_length(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The request ended without a match: the held-back tail is ordinary text after all."""
        text, self.pending = self.pending, ""
        return text

    def _held_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
