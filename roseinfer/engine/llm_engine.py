"""LLMEngine: builds the engine core (scheduler, executor) and puts the request lifecycle API over
it: new_request / add_request (validated, grammar compiled) / step / abort_request, then the
accessors. A finished request stays queryable until its id is returned by pop_finished_ids().
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager, blocks_for
from roseinfer.engine.core import EngineCore
from roseinfer.engine.draft_model import DraftModelProposer
from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import Scheduler
from roseinfer.engine.speculative import SpecStats
from roseinfer.engine.state_pool import StatePool
from roseinfer.engine.structured_output import CompiledGrammar, GrammarCompiler
from roseinfer.executor.executor import Executor, make_executor
from roseinfer.loader.generation_config import sampling_defaults
from roseinfer.loader.model_loader import load_model_config, resolve_model_folder
from roseinfer.engine.pooling import check_dimensions
from roseinfer.loader.pooling_config import pooling_defaults
from roseinfer.pooling_params import PoolingParams
from roseinfer.models.config import ModelConfig
from roseinfer.platforms import platform_for, resolve_device
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from roseinfer.tokenizer import Tokenizer
from roseinfer.worker.sharding import check_tensor_parallel
from roseinfer.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)
# an embedding request samples nothing; max_tokens 1 keeps the context check (a position for the output)
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        size = config.tensor_parallel_size
        # --num-threads (else torch's default) is the engine's: each tensor-parallel rank takes its share
        threads = config.num_threads or (torch.get_num_threads() if size > 1 else None)
        if threads:
            torch.set_num_threads(max(1, threads // size))
        self.device = torch.device(resolve_device(config.device))
        self.platform = platform_for(self.device)
        self.platform.check(size)
        self.dtype = self.platform.default_dtype if config.dtype == "auto" else DTYPES[config.dtype]
        self.model_folder = resolve_model_folder(config.model, config.quantization)
        self.model_config = load_model_config(self.model_folder)
        check_tensor_parallel(self.model_config, size)
        check_hybrid(self.model_config, config)
        self.tokenizer = Tokenizer(self.model_folder)
        self.sampling_defaults = sampling_defaults(self.model_folder, config.generation_config,
                                                   config.override_generation_config)
        try:
            self.default_sampling_params()
        except ValueError as exc:
            raise ValueError(f"the generation config's sampling defaults: {exc}") from None
        self.pooling_defaults = pooling_defaults(self.model_folder)  # what embedding requests use
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.executor: Executor | None = None
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        self.core = EngineCore(self.scheduler, self.executor, self._async_scheduling(config))
        # built on the first constrained request: wrapping the tokenizer takes a moment for a large vocabulary
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()
        self.load_seconds = time.perf_counter() - start

    def _start(self, config: EngineConfig) -> None:
        """The executor (every rank's Worker: model, backend, pool, runner), the draft model, the
        block manager and the scheduler."""
        self.executor = make_executor(WorkerSpec(
            config, self.model_folder, config.attention_backend, self.dtype, self.max_model_len, config.quantization,
            config.tensor_parallel_size), self.device, torch.get_num_threads())
        self.backend = self.executor.driver.backend  # rank 0's
        spec = config.speculative
        # before the pool is sized, so on CUDA the draft's weights and pool count against the budget
        # (under tensor parallelism the draft runs on rank 0 alone, whole)
        proposer = (DraftModelProposer(spec, config, self.model_config, self.max_model_len, self.device, self.dtype)
                    if spec is not None and spec.method == "draft_model" else None)
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        if self.num_kv_blocks < 1:
            raise ValueError("the KV cache budget is too small for even one block")
        eos = self.tokenizer.eos_token_ids
        self.executor.init_kv_cache(self.num_kv_blocks, eos, capture=not config.enforce_eager)
        self.runner = self.executor.driver.runner  # rank 0's
        hybrid = bool(self.model_config.linear_layers)
        if hybrid and config.enable_prefix_caching:
            # a hit would need the linear layers' state at the cached boundary, which no block keeps
            logger.warning("prefix caching is off for %s: its linear-attention state is not snapshotted at "
                           "block boundaries, so a cached prefix could not restore it", self.model_config.model_type)
        num_slots = self.executor.driver.num_state_slots
        if hybrid and num_slots < 1:
            raise ValueError("the KV cache budget is too small for even one linear-attention state slot")
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching and not hybrid, self.model_config.kv_window,
                                          state_pool=StatePool(num_slots) if hybrid else None)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, eos, proposer)

    def _async_scheduling(self, config: EngineConfig) -> bool:
        """auto: where the device runs ahead of the host; never with drafts, proposed from each step's
        tokens on the host, nor where the executor cannot launch ahead (tensor parallelism)."""
        if config.speculative is not None or not self.executor.launches_ahead:
            if config.async_scheduling == "on":
                logger.info("async scheduling: off (speculative decoding or tensor parallelism)")
            return False
        return config.async_scheduling == "on" or (config.async_scheduling == "auto" and self.platform.runs_ahead)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks' processes (also done when the engine is garbage-collected
        and at exit); a no-op without them. The engine runs no steps afterwards."""
        if self.executor is not None:
            self.executor.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults applied (vLLM's behaviour)."""
        return SamplingParams(**self.sampling_defaults)

    # ---- lifecycle -----------------------------------------------------------------------
    def new_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, grammar: CompiledGrammar | None = None,
                    pooling_params: PoolingParams | None = None) -> Request:
        """A request validated and ready for the core (add_request, or a server's worker: EngineCore.add);
        safe from any thread. `grammar`: its structured_outputs already compiled (compile_grammar),
        else compiled here. With `pooling_params` it is an embedding request: its prompt's pooled
        hidden state comes back on its final output, and no token is generated."""
        if pooling_params is not None:
            check_dimensions(pooling_params, self.model_config)
            sampling_params = EMBEDDING_SAMPLING
        params = sampling_params or self.default_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
        return Request(request_id, prompt_ids, params, generator=generator,
                       grammar=grammar.matcher() if grammar is not None else None,
                       long_rope_from=self.model_config.long_rope_from, pooling_params=pooling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, grammar: CompiledGrammar | None = None) -> str:
        req = self.new_request(prompt, sampling_params, request_id, grammar)
        self.core.add(req)
        return req.request_id

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len, self.num_kv_blocks,
                         self.config.block_size)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer.backend_json(), self.model_config.vocab_size,
                                                         self.tokenizer.eos_token_ids)
            return self._grammar_compiler

    def compile_grammar(self, params: StructuredOutputsParams, max_bytes: int | None = None) -> CompiledGrammar:
        """A constraint compiled for add_request; safe from any thread (a server compiles in its own).
        ValueError says why it cannot be enforced; ConstraintTooLarge, that its grammar is over `max_bytes`."""
        return self.grammar_compiler.compile(params, max_bytes)

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        """Abort a waiting or running request and free its blocks at once: its final output, or None
        if it is unknown or already finished."""
        return self.core.abort(request_id)

    # ---- accessors -----------------------------------------------------------------------
    def pop_finished_ids(self) -> list[str]:
        return self.core.pop_finished_ids()

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.core.requests:
            raise KeyError(f"unknown request id {request_id!r}")
        return self.core.requests[request_id]

    def get_generated_ids(self, request_id: str) -> list[int]:
        return list(self.get_request(request_id).output_token_ids)

    def get_step_count(self, request_id: str) -> int:
        return self.get_request(request_id).step_count

    def is_finished(self, request_id: str) -> bool:
        return self.get_request(request_id).is_finished

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def speculative_stats(self) -> dict[str, float]:
        """Drafts verified, tokens proposed and accepted, mean tokens per verification (zeros
        without speculative_config)."""
        proposer = self.scheduler.proposer
        return (proposer.stats if proposer is not None else SpecStats()).as_dict()

    def kv_cache_stats(self) -> dict[str, int]:
        """The block manager's counters, and preemptions since the engine started."""
        return {**self.block_manager.stats_dict(), "num_preemptions": self.scheduler.num_preemptions}


def check_hybrid(model_config: ModelConfig, config: EngineConfig) -> None:
    """What a hybrid model (linear-attention layers) cannot run with, refused before any worker starts.
    Speculative decoding is not among them: a verified draft keeps the state after each of its
    positions and the accepted one is committed (worker/model_runner.py)."""
    if not model_config.linear_layers:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError(f"{model_config.model_type} runs on one rank: tensor_parallel_size must be 1")


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                     num_kv_blocks: int, block_size: int) -> None:
    """The engine's checks on one request, from configuration alone: a process that routes requests
    to engines elsewhere (server/replicas.py) runs them before anything is sent."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    params.check_vocab(vocab)
    total = len(prompt_ids) + params.max_tokens
    if len(prompt_ids) >= max_model_len or total > max_model_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                         f"exceeds the model's context length ({max_model_len})")
    needed = blocks_for(total, block_size)
    if needed > num_kv_blocks:
        raise ValueError(f"prompt + max_tokens needs {needed} KV blocks but the pool has only "
                         f"{num_kv_blocks}; lower max_tokens or raise num_kv_blocks")
