"""The platform layer (roseinfer/platforms): one per device, what the CPU's answers are, and no generic
file asking which device it runs on."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from roseinfer.platforms import platform_for, resolve_device

PACKAGE = Path(__file__).resolve().parent.parent / "roseinfer"
# hardware-specific code: the platforms themselves and the backends that exist for one device
HARDWARE_SPECIFIC = ("platforms", "backends/cpu", "backends/triton")
DEVICE_QUESTIONS = re.compile(r"device\.type|\.is_cuda\b|torch\.cuda\.")


def test_no_generic_file_asks_for_the_device() -> None:
    asking = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(HARDWARE_SPECIFIC):
            continue
        asking += [f"{relative}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                   if DEVICE_QUESTIONS.search(line)]
    assert not asking, f"ask the platform instead: {asking}"


def test_cpu_platform() -> None:
    platform = platform_for(torch.device("cpu"))
    assert platform is platform_for(torch.device("cpu"))  # chosen once
    assert platform.default_dtype == torch.float32 and not platform.runs_ahead
    assert platform.backends == ("cpu", "torch")
    host = torch.arange(4)
    assert platform.upload(host) is host  # nothing to copy
    pool = platform.allocate_kv_pool((2, 3, 4), torch.float32)
    assert pool.shape == (2, 3, 4) and not pool.any()
    assert resolve_device("cpu") == "cpu"


def test_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="no platform"):
        platform_for(torch.device("meta"))
