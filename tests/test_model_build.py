"""Building a model gives its linears and embedding tables no values of their own: the checkpoint sets
every weight, so a weight that stays in GGUF blocks never commits its fp32 memory, and a checkpoint
that lacks one is refused rather than leaving it unset."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from roseinfer import LLM
from roseinfer.distributed.parallel import SINGLE, vocab_parallel_embedding
from roseinfer.layers.linear import Linear

MIB = 1 << 20


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_built_weights_commit_no_memory_until_written() -> None:
    before = _resident_bytes()
    modules = [Linear(8192, 8192), vocab_parallel_embedding(65536, 1024, SINGLE)]  # 256 MB of fp32 each
    grown = _resident_bytes() - before
    assert grown < 32 * MIB, f"building {len(modules)} modules committed {grown / MIB:.0f} MB"


def test_a_checkpoint_missing_a_weight_is_refused(tiny_model_factory, tmp_path: Path) -> None:
    folder = tmp_path / "partial"
    shutil.copytree(tiny_model_factory("llama"), folder)
    weights = load_file(folder / "model.safetensors")
    name = next(n for n in weights if n.endswith("layers.0.mlp.down_proj.weight"))
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint is missing 1 tensor"):
        LLM(model=str(folder), num_kv_blocks=8)
