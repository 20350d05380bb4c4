"""What the benchmark tests share: their thread count, reading figures off the printout, and the
scripts under benchmarks/ (not a package) loaded as modules."""
from __future__ import annotations

import importlib.util
import re
from decimal import Decimal
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# One torch thread: on a small shared CPU, tiny matmuls spread over two threads spend
# most of their time waking the second one (20x slower here).
ONE_THREAD = ["--num-threads", "1"]


def reported_values(text: str, label: str) -> list[float]:
    """Every figure printed as `label: value` on a line of its own, in order."""
    return [float(x) for x in re.findall(rf"^{re.escape(label)}: ([0-9.]+)", text, flags=re.M)]


def printed_bounds(text: str) -> tuple[float, float]:
    """The interval a figure printed as `text` was rounded from: half a unit of its last digit
    either side ("0.15" -> 0.145..0.155, "4.06e-05" -> 4.055e-05..4.065e-05)."""
    value = Decimal(text)
    half = Decimal(5).scaleb(value.as_tuple().exponent - 1)
    return float(value - half), float(value + half)


def benchmark_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, to call its functions."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
