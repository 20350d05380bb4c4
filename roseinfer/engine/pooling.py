"""An embedding request's pooled hidden state, built up over its prompt's chunks: the runner hands
each step's part (a chunk's row sum for mean pooling, the last row for last-token pooling, the
first row for cls pooling) and the request keeps the running value until its prompt is done."""
from __future__ import annotations

import torch

from roseinfer.engine.request import Request
from roseinfer.models.config import ModelConfig
from roseinfer.pooling_params import PoolingParams


def add_part(req: Request, part: torch.Tensor | None) -> None:
    if part is not None:
        req.pooled = part if req.pooled is None else req.pooled + part


def embedding(req: Request) -> list[float]:
    """The finished prompt's vector, as plain floats."""
    params = req.pooling_params
    vector = req.pooled / req.num_prompt_tokens if params.pooling == "mean" else req.pooled
    if params.dimensions is not None:
        vector = vector[..., :params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.cpu().tolist()


def check_dimensions(params: PoolingParams, config: ModelConfig) -> None:
    """A ValueError unless the model has vectors of `params.dimensions` values: its hidden size, or a
    shorter one its config.json declares (vLLM's keys: `matryoshka_dimensions` lists the sizes
    trained, `is_matryoshka` allows any)."""
    size, hidden = params.dimensions, config.hidden_size
    if size is None or size == hidden:
        return
    trained = config.raw_config.get("matryoshka_dimensions")
    if trained is None and not config.raw_config.get("is_matryoshka"):
        raise ValueError(f"dimensions must be the model's hidden size, {hidden}: its config.json declares no "
                         "shorter (Matryoshka) embeddings")
    if size > hidden or (trained is not None and size not in trained):
        allowed = f"one of {sorted(set(trained) | {hidden})}" if trained is not None else f"at most {hidden}"
        raise ValueError(f"dimensions must be {allowed}, got {size}")
