"""Per-request sampling settings, validated once at construction (vLLM's names).

BOUNDS is the one statement of each numeric field's range: SamplingParams checks it, and the
server's request models publish it in their OpenAPI schema (server/protocol.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

SAMPLING_EPS = 1e-5  # a temperature below this samples greedily, as in vLLM (logits / 1e-6 is noise)
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def describe(self) -> str:
        parts = [f"{op} {value}" for op, value in ((">=", self.ge), (">", self.gt), ("<=", self.le)) if value is not None]
        return " and ".join(parts)

    def field_kwargs(self) -> dict[str, float]:
        """As pydantic.Field's keyword arguments."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}


BOUNDS: dict[str, Bounds] = {
    "temperature": Bounds(ge=0), "top_p": Bounds(gt=0, le=1), "top_k": Bounds(ge=-1), "min_p": Bounds(ge=0, le=1),
    "seed": Bounds(ge=SEED_MIN, le=SEED_MAX), "max_tokens": Bounds(ge=1), "min_tokens": Bounds(ge=0),
    "repetition_penalty": Bounds(gt=0), "presence_penalty": Bounds(ge=-2, le=2),
    "frequency_penalty": Bounds(ge=-2, le=2), "logprobs": Bounds(ge=0), "prompt_logprobs": Bounds(ge=0),
}
INT_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, enforced token by token (vLLM's names); exactly one is set.
    json: a JSON schema (dict or its JSON text); regex: the whole output matches it; choice: the
    output is one of these strings; grammar: a Lark grammar (llguidance's dialect, EBNF-like);
    json_object: any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))


class RequestOutputKind(Enum):
    """How a request's output reaches its reader (vLLM's name)."""

    DELTA = "delta"  # the new text as it comes, every stream_interval tokens
    FINAL_ONLY = "final_only"  # everything at once when it ends: nothing decoded or delivered before


@dataclass
class SamplingParams:
    temperature: float = 1.0  # below SAMPLING_EPS: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # text that ends the output where it first appears (cut off, unless include_stop_str_in_output)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; N >= 0: chosen token plus N alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (the first gets None)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == 0:
            self.top_k = -1
        self._check()
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0

    def _check(self) -> None:
        for name, bounds in BOUNDS.items():
            value: Any = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if name in INT_FIELDS:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{name} must be an integer, got {value!r}")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if not bounds.holds(value):
                raise ValueError(f"{name} must be {bounds.describe()}, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite numbers")

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
