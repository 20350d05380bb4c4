"""LLMEngine: the request lifecycle API over the scheduler and the model runner.

Callers never reach into internals: add_request / step / abort_request, then the accessors.
A finished request stays queryable until its id is returned by pop_finished_ids().
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from roseinfer.config import EngineConfig, resolve_device
from roseinfer.backends import select_backend
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.draft_model import DraftModelProposer
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.request import Request, RequestOutput
from roseinfer.engine.sampler import Sampler
from roseinfer.engine.scheduler import Scheduler
from roseinfer.engine.speculative import SpecStats
from roseinfer.engine.structured_output import GrammarCompiler, GrammarMatcher
from roseinfer.loader.generation_config import sampling_defaults
from roseinfer.loader.model_loader import load_model, load_model_config, resolve_model_folder
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(resolve_device(config.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        self.dtype = DTYPES["bfloat16" if config.dtype == "auto" and self.device.type == "cuda" else
                            "float32" if config.dtype == "auto" else config.dtype]
        self.model_folder = resolve_model_folder(config.model, config.quantization)
        self.model_config = load_model_config(self.model_folder)
        self.tokenizer = Tokenizer(self.model_folder)
        self.sampling_defaults = sampling_defaults(self.model_folder, config.generation_config,
                                                   config.override_generation_config)
        try:
            self.default_sampling_params()
        except ValueError as exc:
            raise ValueError(f"the generation config's sampling defaults: {exc}") from None
        self.backend = select_backend(config.attention_backend, self.device, self.dtype, self.model_config)
        model = load_model(self.model_folder, self.model_config, self.dtype, self.device, self.backend,
                           config.quantization)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        spec = config.speculative
        # before the pool is sized, so on CUDA the draft's weights and pool count against the budget
        proposer = (DraftModelProposer(spec, config, self.model_config, self.max_model_len, self.device, self.dtype)
                    if spec is not None and spec.method == "draft_model" else None)
        self.num_kv_blocks = config.num_kv_blocks or self._auto_num_blocks(model)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, eos, proposer)
        self.runner = ModelRunner(model, self.model_config, self.num_kv_blocks, config.block_size, self.backend,
                                  Sampler(eos, self.device, config.seed, self.backend.argmax))
        if not config.enforce_eager:
            self.runner.capture(config.max_num_seqs, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.grammar_compiler: GrammarCompiler | None = None  # built on the first constrained request
        self._ids = itertools.count()
        self.load_seconds = time.perf_counter() - start

    def _auto_num_blocks(self, model: torch.nn.Module) -> int:
        config = self.config
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        step_tokens = min(config.max_num_batched_tokens, self.max_model_len)
        budget = self.backend.kv_pool_bytes(config, lambda: ModelRunner.profile(
            model, self.model_config, self.backend, config.block_size, step_tokens, config.max_num_seqs))
        # never more than every sequence at full length could use
        ceiling = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        blocks = min(int(budget // per_block), ceiling)
        if blocks < 1:
            raise ValueError("the KV cache budget is too small for even one block")
        return blocks

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults applied (vLLM's behaviour)."""
        return SamplingParams(**self.sampling_defaults)

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = sampling_params or self.default_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(request_id, prompt_ids, params, generator=generator, grammar=self._grammar(params))
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        params.check_vocab(vocab)
        total = len(prompt_ids) + params.max_tokens
        if len(prompt_ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the model's context length ({self.max_model_len})")
        needed = self.block_manager.blocks_needed(total)
        if needed > self.num_kv_blocks:
            raise ValueError(f"prompt + max_tokens needs {needed} KV blocks but the pool has only "
                             f"{self.num_kv_blocks}; lower max_tokens or raise num_kv_blocks")

    def _grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.tokenizer.backend_json(), self.model_config.vocab_size,
                                             self.tokenizer.eos_token_ids)
        return self.grammar_compiler.matcher(params.structured_outputs)

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        return self.scheduler.update(out, *self.runner.execute(out))

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
