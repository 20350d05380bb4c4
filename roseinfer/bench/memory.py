"""Peak resident memory of this process against the engine's budget: weights + KV pool + 300 MB.

Linux keeps the high-water mark in /proc/self/status (VmHWM) and resets it when "5" is written to
/proc/self/clear_refs, so each engine's peak can be read on its own even in one bench process.
"""
from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from roseinfer.platforms.cpu_memory import return_freed_memory
from roseinfer.layers.linear import linear_layers

if TYPE_CHECKING:
    from roseinfer.engine.llm_engine import LLMEngine

RUNTIME_ALLOWANCE_BYTES = 300 * 10**6  # Python, torch, tokenizer and activations on top of weights + KV
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


class EnginePeakRss:
    """The process's resident high-water mark from now on, leaving out what `excluding` wraps: the
    bench's floor samples run beside the engine in its process, and their activations (glibc keeps
    what they touched) are not the engine's. Around such a call the mark so far is kept, the freed
    memory handed back to the OS, and the mark restarted. Where the OS cannot restart it, the
    peak covers everything."""

    def __init__(self) -> None:
        self.earlier = 0
        reset_peak_rss()

    def excluding(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        def call(arg: str) -> None:
            self.earlier = max(self.earlier, peak_rss_bytes())
            fn(arg)
            return_freed_memory()
            reset_peak_rss()

        return call

    def bytes(self) -> int:
        return max(self.earlier, peak_rss_bytes())


def reset_peak_rss() -> bool:
    """Starts a new high-water mark; False where the OS cannot (the peak then covers the process)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The resident high-water mark since the last reset (or since the process started)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def engine_memory(engine: LLMEngine, peak: int) -> dict[str, float]:
    """The engine's weights, KV pool, budget and the measured peak, in MB (10^6 bytes)."""
    runner = engine.runner
    # The checkpoint's weights: dense parameters plus the copies a backend put in place of linear
    # weights (packed). A tied LM head's copy duplicates the embedding's table, so it counts as
    # overhead, unless the embedding has no table and reads its rows from that copy.
    model = runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table_in_head = any(isinstance(m, nn.Embedding) and m.weight is None for m in model.modules())
    weights += sum(layer.weight_bytes() for layer in linear_layers(model) if layer.weight is None
                   and not (layer is model.lm_head and model.cfg.tie_word_embeddings and not table_in_head))
    kv_pool = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    mb = 10**6
    return {"weights_mb": weights / mb, "kv_pool_mb": kv_pool / mb, "peak_rss_mb": peak / mb,
            "rss_budget_mb": (weights + kv_pool + RUNTIME_ALLOWANCE_BYTES) / mb}
