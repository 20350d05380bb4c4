"""An embedding request's pooled hidden state, built up over its prompt's chunks: the runner hands
each step's part (a chunk's row sum for mean pooling, the last row for last-token pooling, the
first row for cls pooling) and the request keeps the running value until its prompt is done."""
from __future__ import annotations

import torch

from roseinfer.engine.request import Request


def add_part(req: Request, part: torch.Tensor | None) -> None:
    if part is not None:
        req.pooled = part if req.pooled is None else req.pooled + part


def embedding(req: Request) -> list[float]:
    """The finished prompt's vector, as plain floats."""
    vector = req.pooled / req.num_prompt_tokens if req.pooling_params.pooling == "mean" else req.pooled
    if req.pooling_params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.cpu().tolist()
