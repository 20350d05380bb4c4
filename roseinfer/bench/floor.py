"""The matmul floor: a decode step that does only the model's matmuls (no attention, norms,
engine or sampling), on the model's own weights, same shapes, same threads. Its tokens/s is the
ceiling an engine can approach on this machine; the engine's ratio to it is the efficiency claim."""
from __future__ import annotations

import time

import torch
from torch import nn


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every matmul weight of one forward, in order: each nn.Linear, then the LM head."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    head = getattr(model, "lm_head", None)
    if head is None:  # tied head: the embedding matrix is the LM head's weight
        embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
        weights.append(embedding.weight)
    return weights


@torch.inference_mode()
def matmul_floor(model: nn.Module, batch_size: int, steps: int = 20, warmup: int = 3) -> float:
    """Decode tokens/s of a loop doing only the model's matmuls for `batch_size` sequences."""
    weights = linear_weights(model)
    inputs = {w.shape[1]: torch.randn(batch_size, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError("matmul_floor needs batch_size >= 1, steps >= 1, warmup >= 0")
    cuda = weights[0].device.type == "cuda"
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()  # the warmup's queued kernels stay out of the timing
            start = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
    if cuda:
        torch.cuda.synchronize()
    return batch_size * steps / (time.perf_counter() - start)
