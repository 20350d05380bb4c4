"""Triton kernels on CPU tensors: import this before triton. Where no CUDA device is present it
turns TRITON_INTERPRET=1 on, so kernels run in Triton's interpreter (numpy underneath), and
`device()` names where the tests' tensors go."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def patch_interpreter() -> None:
    """Triton < 3.8's interpreter takes a loop bound held in a tensor with int() of a 1-element
    array, which numpy >= 2.4 refuses (only 0-d arrays convert); 3.8 squeezes first, as this does."""
    import triton
    from triton.runtime import interpreter

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 8):
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_index", False):
        return

    def patched(tensor: type) -> None:
        original(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched
