"""The matmul floors: a decode step, or a prefill, doing only the model's matmuls (no attention,
norms, engine or sampling), through the model's own linear layers (so with the same prepacked
oneDNN weights the engine uses, layers/linear.py), same shapes, same threads. Their tokens/s are
the ceiling an engine can approach on this machine; the engine's ratio to them is the efficiency
claim.

Where the CPU backend runs a decode step's layers from C in one call (backends/cpu/llama.py), with
no Python between matmuls, the decode floor runs its matmuls from one C loop too (Backend.matmul_loop):
called one by one from Python they would pay a call's cache-cold Python each that the engine no
longer pays, and the engine would beat its own floor.

On a GPU a decode step is bound by memory, not matmuls: the bandwidth floor is the bytes a step
must read (decode_step_bytes) over the copy bandwidth measured in the same run (copy_bandwidth)."""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from roseinfer.backends.base import Backend
from roseinfer.layers.linear import Linear, linear_layers
from roseinfer.platforms import platform_for


def _timed(run: Callable[[], None], device: torch.device) -> float:
    """Seconds `run` took, with the device's queued work included."""
    platform = platform_for(device)
    platform.synchronize()  # earlier queued kernels stay out of the timing
    start = time.perf_counter()
    run()
    platform.synchronize()
    return time.perf_counter() - start


def _activation_like(model: nn.Module) -> torch.Tensor:
    """A floating-point parameter of the model: the activations' dtype and device (a weight kept in
    GGUF blocks is uint8)."""
    return next(p for p in model.parameters() if p.is_floating_point())


def _inputs(layers: list[Linear], rows: int, reference: torch.Tensor) -> dict[int, torch.Tensor]:
    """One random activation per input width of `layers` (dtype and device of `reference`)."""
    return {n: torch.randn(rows, n, dtype=reference.dtype, device=reference.device)
            for n in {layer.in_features for layer in layers}}


@torch.inference_mode()
def matmul_floor(model: nn.Module, backend: Backend, batch_size: int, steps: int = 20, warmup: int = 3) -> float:
    """Decode tokens/s of a loop doing only the model's matmuls for `batch_size` sequences, as the
    backend runs them (from one C loop where its decode steps run their layers in C)."""
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError("matmul_floor needs batch_size >= 1, steps >= 1, warmup >= 0")
    layers = linear_layers(model)
    reference = _activation_like(model)
    decode_steps = backend.matmul_loop(layers, _inputs(layers, batch_size, reference))
    decode_steps(warmup)
    return batch_size * steps / _timed(lambda: decode_steps(steps), reference.device)


@torch.inference_mode()
def prefill_matmul_floor(model: nn.Module, num_prompts: int, prompt_len: int, step_tokens: int) -> float:
    """Prompt tokens/s of only the matmuls of prefilling `num_prompts` prompts of `prompt_len`
    tokens, `step_tokens` rows per step as the engine's token budget splits them: every layer but
    the LM head on all the rows, the LM head on one row per prompt (the engine computes logits for
    a prompt's last position only). One untimed step of the largest size comes first."""
    if num_prompts < 1 or prompt_len < 1 or step_tokens < 1:
        raise ValueError("prefill_matmul_floor needs num_prompts, prompt_len and step_tokens >= 1")
    layers = linear_layers(model)
    body, head = layers[:-1], layers[-1]
    total = num_prompts * prompt_len
    steps = [step_tokens] * (total // step_tokens) + [total % step_tokens] * (total % step_tokens > 0)
    reference = _activation_like(model)
    inputs = _inputs(body, max(steps), reference)
    head_input = _inputs([head], num_prompts, reference)[head.in_features]

    def prefill(row_counts: list[int], with_head: bool) -> None:
        for rows in row_counts:
            for layer in body:
                layer(inputs[layer.in_features][:rows])
        if with_head:
            head(head_input)

    prefill(steps[:1], False)
    return total / _timed(lambda: prefill(steps, True), reference.device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, bytes read and written both counted (the figure a memory
    bound is quoted in): the bandwidth floor's yardstick, measured in the run it is compared in."""
    if nbytes < 4 or repeats < 1:
        raise ValueError("copy_bandwidth needs nbytes >= 4 and repeats >= 1")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: pages and caches are set up outside the timing
    seconds = _timed(lambda: [dst.copy_(src) for _ in range(repeats)], device)
    return 2 * src.numel() * 4 * repeats / seconds


def decode_step_bytes(model: nn.Module, kv_bytes_per_token: int, context_lens: list[int]) -> int:
    """Bytes a decode step must read at least: every matmul weight once (the LM head included) and
    every sequence's whole KV context; activations, norms and the step's new K/V are left out."""
    weights = sum(layer.weight_bytes() for layer in linear_layers(model))
    return weights + kv_bytes_per_token * sum(context_lens)
