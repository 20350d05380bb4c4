"""roseinfer: a small, fast LLM inference engine."""
from roseinfer.config import EngineConfig
from roseinfer.llm import LLM, CompletionOutput
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"
