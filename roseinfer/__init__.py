"""roseinfer: a small, fast LLM inference engine."""
from roseinfer.config import EngineConfig
from roseinfer.llm import LLM, CompletionOutput
from roseinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"
