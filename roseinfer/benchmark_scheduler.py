"""The blog's ``python -m roseinfer.benchmark_scheduler ...``: the same as ``roseinfer bench offline``."""

import sys

from roseinfer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("offline", prog="python -m roseinfer.benchmark_scheduler"))
