"""Per-request sampling settings, validated once at construction (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; N >= 0: chosen token plus N alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (the first gets None)

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == 0:
            self.top_k = -1
        self._check()

    def _check(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "an integer between 0 and max_tokens")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "None or an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist; called once the model is known."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad_ids = [i for i in ids if not 0 <= i < vocab_size]
            if bad_ids:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad_ids[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} asks for {value} alternatives but the vocabulary has {vocab_size} tokens")
