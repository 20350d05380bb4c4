"""What the `bench offline` tests share: their thread count and reading figures off the printout."""
from __future__ import annotations

import re

# One torch thread: on a small shared CPU, tiny matmuls spread over two threads spend
# most of their time waking the second one (20x slower here).
ONE_THREAD = ["--num-threads", "1"]


def reported_values(text: str, label: str) -> list[float]:
    """Every figure printed as `label: value` on a line of its own, in order."""
    return [float(x) for x in re.findall(rf"^{re.escape(label)}: ([0-9.]+)", text, flags=re.M)]
