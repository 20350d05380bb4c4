"""The blog's ``python -m roseinfer.benchmark_streaming ...``: the same as ``roseinfer bench streaming``."""

import sys

from roseinfer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("streaming", prog="python -m roseinfer.benchmark_streaming"))
