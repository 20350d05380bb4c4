"""What a reasoning parser hands on for each piece of a reply (reasoning.py's, harmony.py's)."""
from __future__ import annotations

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
