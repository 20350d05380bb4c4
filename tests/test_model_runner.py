"""The model runner's KV pool, and the resident memory of reading a checkpoint."""
from __future__ import annotations

import pathlib

import torch

from roseinfer import LLM, SamplingParams
from roseinfer.engine.model_runner import ModelRunner


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cpu_pool_is_zeroed_and_committed_lazily(tiny_model_factory) -> None:
    """A 256 MB pool costs resident memory only for the pages a request touches; it reads as zeros."""
    folder = tiny_model_factory("llama")
    probe = LLM(model=str(folder), num_kv_blocks=1).engine
    per_block = ModelRunner.kv_bytes_per_block(probe.model_config, probe.config.block_size, probe.dtype)
    before = _rss_bytes()
    llm = LLM(model=str(folder), num_kv_blocks=2**28 // per_block)
    caches = llm.engine.runner.kv_caches
    pool_bytes = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    assert pool_bytes > 0.99 * 2**28
    assert _rss_bytes() - before < 0.25 * pool_bytes
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # the touched slots hold K/V now; everything past them is still the OS's zero pages
    k_cache = caches[0][0]
    assert k_cache[:8].abs().sum() > 0
    assert torch.count_nonzero(k_cache[llm.engine.config.block_size * 4:]) == 0


def test_reading_a_checkpoint_keeps_one_tensor_mapped_at_a_time(tmp_path) -> None:
    """safetensors maps the file; pages read stay resident while the mapping is open. The loader
    holds it open per tensor, so reading 8 x 32 MB never holds more than a tensor or two."""
    from safetensors.torch import save_file

    from roseinfer.loader.model_loader import iter_safetensors

    tensor_bytes = 32 * 2**20
    save_file({f"w{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(8)}, str(tmp_path / "model.safetensors"))
    before = _rss_bytes()
    peak = 0
    for name, tensor in iter_safetensors(tmp_path):
        assert float(tensor.sum()) == float(name[1:]) * tensor.numel()  # every page of it read
        peak = max(peak, _rss_bytes() - before)
        del tensor
    assert peak < 3 * tensor_bytes
