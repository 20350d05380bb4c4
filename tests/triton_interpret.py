"""Triton kernels on CPU tensors: where no CUDA device is present, conftest.py turns
TRITON_INTERPRET=1 on before anything imports triton, so kernels run in Triton's interpreter (numpy
underneath); `device()` names where the tests' tensors go, and `patch_interpreter` mends an old
interpreter."""
from __future__ import annotations

import torch


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def backend_device() -> torch.device:
    """Where the Triton backend's tests run, the interpreter mended; a skip where the backend cannot run."""
    import pytest

    from roseinfer.backends.triton import TritonBackend

    patch_interpreter()
    if not TritonBackend.supports(device(), torch.float32):
        pytest.skip("the Triton backend cannot run here")
    return device()


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
