"""What the sampler sends to the device each step, in one copy per dtype."""
from __future__ import annotations

import array
import math

import torch

from roseinfer.platforms import platform_for

Tensors = dict[str, torch.Tensor]


class HostBuffer:
    """Named sections of one dtype gathered in one host array, moved to the device in one copy
    and handed back as views ("q": int64, "f": float32)."""

    def __init__(self, typecode: str) -> None:
        self.values = array.array(typecode)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, values: list) -> None:
        self.shapes[name] = (len(values),)
        self.values.extend(values)

    def add_rows(self, name: str, rows: list[list], pad: int | float) -> None:
        """Rows padded with pad to the longest one."""
        width = max(map(len, rows))
        self.shapes[name] = (len(rows), width)
        for row in rows:
            self.values.extend(row)
            self.values.extend([pad] * (width - len(row)))

    def upload(self, dtype: torch.dtype, device: torch.device) -> Tensors:
        if not self.shapes:
            return {}
        flat, start, views = upload(self.values, dtype, device), 0, {}
        for name, shape in self.shapes.items():
            views[name] = flat[start:start + math.prod(shape)].view(shape)
            start += math.prod(shape)
        return views


def upload(values: array.array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host-to-device copy (none on CPU), not blocking where the platform allows."""
    return platform_for(device).upload(torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype))
