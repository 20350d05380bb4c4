"""The matmul floor: a decode step that does only the model's matmuls (no attention, norms,
engine or sampling), through the model's own linear layers (so with the same prepacked oneDNN
weights the engine uses, layers/linear.py), same shapes, same threads. Its tokens/s is the ceiling
an engine can approach on this machine; the engine's ratio to it is the efficiency claim."""
from __future__ import annotations

import time

import torch
from torch import nn

from roseinfer.layers.linear import linear_layers


@torch.inference_mode()
def matmul_floor(model: nn.Module, batch_size: int, steps: int = 20, warmup: int = 3) -> float:
    """Decode tokens/s of a loop doing only the model's matmuls for `batch_size` sequences."""
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError("matmul_floor needs batch_size >= 1, steps >= 1, warmup >= 0")
    layers = linear_layers(model)
    reference = next(model.parameters())  # dtype and device of the activations
    inputs = {n: torch.randn(batch_size, n, dtype=reference.dtype, device=reference.device)
              for n in {layer.in_features for layer in layers}}
    cuda = reference.device.type == "cuda"
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()  # the warmup's queued kernels stay out of the timing
            start = time.perf_counter()
        for layer in layers:
            layer(inputs[layer.in_features])
    if cuda:
        torch.cuda.synchronize()
    return batch_size * steps / (time.perf_counter() - start)
