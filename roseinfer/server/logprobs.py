"""Logprobs in the response shapes clients read: OpenAI's legacy completions object, OpenAI's
chat object, and vLLM's prompt_logprobs list.

Only finite numbers go out (JSON has no -Infinity): under an output constraint the engine reports
logprobs of the distribution the grammar leaves (masked tokens at -inf), so the tokens it masks are
left out of the alternatives, and a chosen token's -inf (or NaN) becomes -9999.0, the floor that
OpenAI and vLLM send.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from roseinfer.engine.request import TokenLogprobs
from roseinfer.tokenizer import Tokenizer

# (token id, its logprobs); None for a prompt's first token, which nothing predicts
Entry = tuple[int, TokenLogprobs | None]
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _possible(top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The alternatives the output could have taken (a constraint's masked tokens left out)."""
    return [(token_id, value) for token_id, value in top if math.isfinite(value)]


class LogprobsFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: Sequence[Entry], offset: int, num_top: int) -> dict[str, Any]:
        """OpenAI's legacy object; text_offset counts on from `offset`, the top alternatives are
        cut to num_top (prompt entries may carry more, when prompt_logprobs asked for more)."""
        tokens = [self.token_text(token_id) for token_id, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops: list[dict[str, float] | None] = []
        for _, lp in entries:
            if lp is None:
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for token_id, value in _possible(lp.top[:num_top]):  # ids that decode alike (partial UTF-8) keep the best
                top.setdefault(self.token_text(token_id), value)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp.logprob) for _, lp in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def chat(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in _possible(lp.top)]} for lp in logprobs]}

    def prompt(self, logprobs: list[TokenLogprobs | None], num_top: int) -> list[dict[int, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: per prompt token, the token itself and the num_top most likely,
        each with its logprob, rank and text; None for the first token."""
        out: list[dict[int, dict[str, Any]] | None] = []
        for lp in logprobs:
            if lp is None:
                out.append(None)
                continue
            ranked = [(lp.token_id, _finite(lp.logprob), lp.rank)] + [
                (t, v, r) for r, (t, v) in enumerate(_possible(lp.top[:num_top]), 1)]
            entry: dict[int, dict[str, Any]] = {}
            for token_id, value, rank in ranked:
                entry.setdefault(token_id, {"logprob": value, "rank": rank, "decoded_token": self.token_text(token_id)})
            out.append(entry)
        return out
