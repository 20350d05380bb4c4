"""roseinfer: a small, fast LLM inference engine.

The names below are imported on first use (PEP 562), so that importing one submodule does not
import the engine: a tensor-parallel rank's process (executor/rank_processes.py) needs the model and
its backend, not the engine, its scheduler and its sampler.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roseinfer.config import EngineConfig
    from roseinfer.llm import LLM, CompletionOutput
    from roseinfer.pooling_params import PoolingParams
    from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams

_EXPORTS = {"LLM": "roseinfer.llm", "CompletionOutput": "roseinfer.llm", "EngineConfig": "roseinfer.config",
            "SamplingParams": "roseinfer.sampling_params", "StructuredOutputsParams": "roseinfer.sampling_params",
            "PoolingParams": "roseinfer.pooling_params"}
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
