"""Stop strings (SamplingParams.stop), matched on streamed text without ever emitting any part of a
match, or with include_stop_str_in_output, through its end and nothing after."""
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
    kept, so a step costs O(delta + longest stop string), not O(output). With include_in_output,
    nothing is held back (the stop string would be shown anyway) and a match keeps the text
    through the stop string's end.
    """

    stops: list[str]
    include_in_output: bool = False
    pending: str = ""  # received but not yet released, or (include_in_output) the released tail
    matched: str | None = None  # the stop string that ended the text

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise ValueError("stop strings must not be empty")
        self._tail = max(map(len, self.stops), default=1) - 1

    def add(self, delta: str, may_match: bool = True) -> tuple[str, bool]:
        """Append `delta`; return (text to release now, whether a stop string matched). The earliest
        match wins, whichever string it is; only a match that ends in `delta` counts, and none while
        not `may_match` (vLLM's rule: stop strings count once the output is past min_tokens).

        A match cannot start in text already released without include_in_output: that text was
        released only because no suffix of it could begin a stop string. So searching the pending
        tail is enough (with include_in_output the tail is kept for that search).
        """
        text = self.pending + delta
        hits = [(i, i + len(s), s) for i, s in ((text.find(s, max(0, len(self.pending) - len(s) + 1)), s)
                                                for s in self.stops) if i >= 0] if may_match else []
        if hits:
            start, end, self.matched = min(hits)
            self.pending = ""
            if self.include_in_output:
                return text[:end][len(text) - len(delta):], True
            return text[:start], True
        if self.include_in_output:
            self.pending = text[len(text) - self._tail:] if self._tail else ""
            return delta, False
        hold = held_length(text, self.stops)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The request ended without a match: the held-back tail is ordinary text after all."""
        if self.include_in_output:
            return ""
        text, self.pending = self.pending, ""
        return text
