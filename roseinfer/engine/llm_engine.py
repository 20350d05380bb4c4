"""LLMEngine: the request lifecycle API over the scheduler and the model runner.

Callers never reach into internals: add_request / step / abort_request, then the accessors.
A finished request stays queryable until its id is returned by pop_finished_ids().
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from roseinfer.config import EngineConfig, resolve_device
from roseinfer.backends import select_backend
from roseinfer.distributed.parallel import SINGLE, check_tensor_parallel, shard_config
from roseinfer.distributed.workers import Workers, WorkerSpec
from roseinfer.engine.block_manager import BlockManager, blocks_for
from roseinfer.engine.draft_model import DraftModelProposer
from roseinfer.engine.model_runner import ModelRunner, auto_num_blocks
from roseinfer.engine.request import Request, RequestOutput
from roseinfer.engine.sampler import Sampler
from roseinfer.engine.scheduler import Scheduler
from roseinfer.engine.speculative import SpecStats
from roseinfer.engine.structured_output import CompiledGrammar, GrammarCompiler
from roseinfer.loader.generation_config import sampling_defaults
from roseinfer.loader.model_loader import load_model, load_model_config, resolve_model_folder
from roseinfer.models.config import ModelConfig
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from roseinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
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
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if self.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs a GPU per rank; "
                             f"torch sees {torch.cuda.device_count()}")
        self.dtype = DTYPES["bfloat16" if config.dtype == "auto" and self.device.type == "cuda" else
                            "float32" if config.dtype == "auto" else config.dtype]
        self.model_folder = resolve_model_folder(config.model, config.quantization)
        self.model_config = load_model_config(self.model_folder)
        check_tensor_parallel(self.model_config, size)
        self.tokenizer = Tokenizer(self.model_folder)
        self.sampling_defaults = sampling_defaults(self.model_folder, config.generation_config,
                                                   config.override_generation_config)
        try:
            self.default_sampling_params()
        except ValueError as exc:
            raise ValueError(f"the generation config's sampling defaults: {exc}") from None
        local_config = shard_config(self.model_config, size)  # what each rank computes
        self.backend = select_backend(config.attention_backend, self.device, self.dtype, local_config, size)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.workers = None if size == 1 else Workers(WorkerSpec(
            config, self.model_folder, self.backend.name, self.device.type, self.dtype, self.max_model_len,
            torch.get_num_threads()), size, self.device)
        try:
            self._start(config, local_config)
        except BaseException:
            self.shutdown()
            raise
        self.requests: dict[str, Request] = {}
        # built on the first constrained request: wrapping the tokenizer takes a moment for a large vocabulary
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()
        self.load_seconds = time.perf_counter() - start

    def _start(self, config: EngineConfig, local_config: ModelConfig) -> None:
        """The model, the pool, the scheduler and the runner (rank 0's; the workers build their own
        share alongside, distributed/workers.py)."""
        tp = SINGLE if self.workers is None else self.workers.tp
        model = load_model(self.model_folder, self.model_config, self.dtype, self.device, self.backend, tp,
                           config.quantization)
        if self.workers is not None:
            self.workers.wait_ready()
        spec = config.speculative
        # before the pool is sized, so on CUDA the draft's weights and pool count against the budget
        # (under tensor parallelism the draft runs on rank 0 alone, whole)
        proposer = (DraftModelProposer(spec, config, self.model_config, self.max_model_len, self.device, self.dtype)
                    if spec is not None and spec.method == "draft_model" else None)
        if self.workers is not None:
            self.workers.call("size_pool")  # they size theirs now; every rank takes the smallest
        self.num_kv_blocks = tp.min(config.num_kv_blocks or auto_num_blocks(
            model, local_config, self.backend, config, self.max_model_len))
        if self.num_kv_blocks < 1:
            raise ValueError("the KV cache budget is too small for even one block")
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          self.model_config.kv_window)
        eos = self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, eos, proposer)
        self.runner = ModelRunner(model, local_config, self.num_kv_blocks, config.block_size, self.backend,
                                  Sampler(eos, self.device, config.seed, self.backend.argmax), self.workers)
        if not config.enforce_eager:
            self.runner.capture(config.max_num_seqs, self.max_model_len)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is garbage-collected and at
        exit); a no-op without them. The engine runs no steps afterwards."""
        if self.workers is not None:
            self.workers.close()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults applied (vLLM's behaviour)."""
        return SamplingParams(**self.sampling_defaults)

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, grammar: CompiledGrammar | None = None) -> str:
        """`grammar`: the request's structured_outputs already compiled (compile_grammar), else compiled here."""
        params = sampling_params or self.default_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
        req = Request(request_id, prompt_ids, params, generator=generator,
                      grammar=grammar.matcher() if grammar is not None else None,
                      long_rope_from=self.model_config.long_rope_from)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

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

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            results = self.runner.execute(out)
        except BaseException as exc:
            if self.workers is None:
                raise
            error = self.workers.failed(exc)  # which rank died and how; the ranks are stopped
            if not isinstance(exc, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt (the engine is stopped all the same)
            raise error from exc
        return self.scheduler.update(out, *results)

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its blocks at once; False if unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self.scheduler.abort(req)
        return True

    # ---- accessors -----------------------------------------------------------------------
    def pop_finished_ids(self) -> list[str]:
        ids = self.scheduler.pop_finished_ids()
        for request_id in ids:
            self.requests.pop(request_id, None)
        return ids

    def get_request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"unknown request id {request_id!r}")
        return self.requests[request_id]

    def get_generated_ids(self, request_id: str) -> list[int]:
        return list(self.get_request(request_id).output_token_ids)

    def get_step_count(self, request_id: str) -> int:
        return self.get_request(request_id).step_count

    def is_finished(self, request_id: str) -> bool:
        return self.get_request(request_id).is_finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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
