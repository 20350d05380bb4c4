"""PoolingParams: what an embedding request asks of the engine instead of generated tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pooling = Literal["last", "mean", "cls"]
POOLINGS: tuple[str, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """The prompt's final hidden states (after the model's last norm) pooled into one vector:
    "last" takes the last token's (vLLM's default for a decoder LM run as an embedding model, and
    Qwen3-Embedding's), "mean" averages every token's, "cls" takes the first token's; `normalize`
    scales it to unit L2 norm; `dimensions` keeps the vector's first that many values (before
    normalizing), for checkpoints trained to make them an embedding (Matryoshka)."""

    pooling: Pooling = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
