"""A request's penalty counts, kept as its tokens arrive rather than rebuilt from its history each step.

The repetition penalty needs the distinct ids of the prompt and the output, frequency and presence
each output id's count. `update` folds in the tokens appended since its last call, so each
accepted token is counted once, in the step after it was appended. A request's history only
grows: a preempted one keeps its tokens (it is recomputed, not truncated), and a speculative
draft's rejected tokens never enter it (accept_draft runs before the scheduler appends).
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field


@dataclass
class PenaltyCounts:
    num_counted: int = 0  # tokens of the history folded in
    seen: array.array = field(default_factory=lambda: array.array("q"))  # distinct ids, prompt and output
    output_ids: array.array = field(default_factory=lambda: array.array("q"))  # distinct output ids
    output_counts: array.array = field(default_factory=lambda: array.array("f"))  # exact up to 2**24
    _seen: set[int] = field(default_factory=set)
    _output_pos: dict[int, int] = field(default_factory=dict)

    def update(self, token_ids: list[int], num_prompt_tokens: int) -> PenaltyCounts:
        for pos in range(self.num_counted, len(token_ids)):
            token = token_ids[pos]
            if token not in self._seen:
                self._seen.add(token)
                self.seen.append(token)
            if pos < num_prompt_tokens:
                continue
            at = self._output_pos.setdefault(token, len(self.output_ids))
            if at == len(self.output_ids):
                self.output_ids.append(token)
                self.output_counts.append(0.0)
            self.output_counts[at] += 1.0
        self.num_counted = len(token_ids)
        return self
