"""EngineView: what the HTTP layer reads of an engine that runs elsewhere (an engine process, Ray
replicas): the same fields and the same `validate` and `compile_grammar` as LLMEngine, from the
configuration and the limits the engine reported, without its weights."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import validate_request
from roseinfer.engine.structured_output import CompiledGrammar, GrammarCompiler
from roseinfer.loader.generation_config import sampling_defaults
from roseinfer.loader.model_loader import load_model_config, resolve_model_folder
from roseinfer.loader.pooling_config import pooling_defaults
from roseinfer.models.config import ModelConfig
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from roseinfer.tokenizer import Tokenizer


@dataclass
class EngineView:
    config: EngineConfig
    model_folder: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    sampling_defaults: dict[str, Any]
    max_model_len: int
    num_kv_blocks: int
    pooling_defaults: PoolingParams  # what embedding requests use
    _grammar_compiler: GrammarCompiler | None = field(default=None, init=False, repr=False)
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int, num_kv_blocks: int) -> "EngineView":
        """The view of an engine built from `config` that reported these limits (the model folder
        is resolved again: a GGUF file's conversion is cached, so this finds the engine's)."""
        folder = resolve_model_folder(config.model, config.quantization)
        return cls(config, folder, load_model_config(folder), Tokenizer(folder),
                   sampling_defaults(folder, config.generation_config, config.override_generation_config),
                   max_model_len, num_kv_blocks, pooling_defaults(folder))

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len, self.num_kv_blocks,
                         self.config.block_size)

    def compile_grammar(self, params: StructuredOutputsParams, max_bytes: int | None = None) -> CompiledGrammar:
        """As LLMEngine's, to refuse a constraint with a 400 here; a compiled grammar cannot travel to
        the engine's process, which compiles its own copy."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer.backend_json(), self.model_config.vocab_size,
                                                         self.tokenizer.eos_token_ids)
        return self._grammar_compiler.compile(params, max_bytes)
