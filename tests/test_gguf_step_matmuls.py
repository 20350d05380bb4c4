"""benchmarks/gguf_step_matmuls.py builds two copies of the kernels and times a step's matmuls on a
GGUF's blocks: run on a tiny Q4_K file (one row, then enough rows for the tiles), before = after."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from test_native_kernels import needs_kernels
from test_quantized import _tiny_hf

from roseinfer.backends.cpu import kernels

ROOT = Path(__file__).resolve().parents[1]


@needs_kernels
def test_step_matmuls_runs_both_builds_on_every_quantized_weight(tmp_path: Path) -> None:
    tok = make_tiny_tokenizer()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", 256, len(tok)), tok, qtype="Q4_K")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gguf_step_matmuls.py"), "--gguf", str(src),
                           "--before-csrc", str(kernels.CSRC), "--rows", "1,17", "--repeats", "1"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tiny.gguf: ") and " weights, " in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["rows 1", "rows 17"]
