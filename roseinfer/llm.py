"""LLM: the offline API (vLLM's shape) over LLMEngine, in this thread or in an engine process of its own."""
from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import EMBEDDING_SAMPLING, LLMEngine
from roseinfer.engine.pooling import check_dimensions
from roseinfer.engine.request import TokenLogprobs
from roseinfer.engine.speculative import SpecStats
from roseinfer.engine_client.engine_view import EngineView
from roseinfer.engine_client.process_client import EngineProcessClient
from roseinfer.output_processor import OutputProcessor, StreamDelta
from roseinfer.pooling_params import PoolingParams
from roseinfer.reasoning import pick_reasoning_parser
from roseinfer.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
Prompt = str | list[int]
# what a run hands back per prompt: its request id, prompt ids, sampling params and final delta
Finished = tuple[str, list[int], SamplingParams, StreamDelta]


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str  # cut before the stop string that ended it (through it, with include_stop_str_in_output)
    finish_reason: str | None  # "stop" (EOS, a stop token id or string) | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)
    reasoning: str | None = None  # chat() with a reasoning parser: the reasoning, apart from text
    # why the engine ended it early (finish_reason "abort"): a constraint that failed while generating
    error: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class LLM:
    def __init__(self, model: str | None = None, reasoning_parser: str = "none", **engine_options: Any) -> None:
        """reasoning_parser: how chat() splits a thinking model's reasoning from its answer, as
        `roseinfer serve --reasoning-parser` does: "none" (the default: the reply as written),
        "auto", "qwen3" or "deepseek_r1". engine_process="on" runs the engine core in a process of its
        own, as `serve` does; "auto" and "off" step it in the calling thread, which is faster offline
        (docs/profiling.md §9)."""
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self._client: EngineProcessClient | None = None
        self.engine: LLMEngine | EngineView
        if config.engine_process == "on":
            self._client = EngineProcessClient(config)
            self._client.start()
            self.engine = self._client.engine
        else:
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.think_tags = pick_reasoning_parser(self.tokenizer.chat_template, reasoning_parser, self.tokenizer)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[CompletionOutput]:
        """Run prompts (strings or token-id lists, mixed is fine) to completion, in order; with
        use_tqdm, a progress bar on stderr counts finished requests (vLLM's)."""
        prompts = _prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        return [_completion(*finished) for finished in self._run(prompts, params_list, None, use_tqdm)]

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's final hidden state pooled into one vector, in order; vLLM's shape. Without
        PoolingParams, the checkpoint's sentence-transformers pooling, else the last token's, normalized."""
        prompts = _prompt_list(prompts)
        params = pooling_params or self.engine.pooling_defaults
        finished = self._run(prompts, [EMBEDDING_SAMPLING] * len(prompts), params, use_tqdm)
        return [EmbeddingRequestOutput(request_id, prompt_ids, EmbeddingOutput(final.embedding or []))
                for request_id, prompt_ids, _, final in finished]

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams], pooling: PoolingParams | None,
             use_tqdm: bool) -> list[Finished]:
        """Every prompt run to its end, in order; each validated before any reaches the engine."""
        if self._client is None:
            return self._run_here(prompts, params_list, pooling, use_tqdm)
        return self._run_in_engine_process(prompts, params_list, pooling, use_tqdm)

    def _run_here(self, prompts: list[Prompt], params_list: list[SamplingParams], pooling: PoolingParams | None,
                  use_tqdm: bool) -> list[Finished]:
        """Step the engine in this thread until every request is done."""
        engine = self.engine
        assert isinstance(engine, LLMEngine)
        requests = [engine.new_request(prompt, params, pooling_params=pooling)
                    for prompt, params in zip(prompts, params_list)]
        processor = OutputProcessor(self.tokenizer)
        finals: dict[str, StreamDelta] = {}
        try:
            for req in requests:
                engine.core.add(req)
                processor.add_request(req.request_id, req.prompt_token_ids, req.sampling_params, final_only=True)
            with _Progress(len(requests), use_tqdm) as progress:
                while processor.has_requests():
                    processed = processor.process(engine.step(), time.perf_counter())
                    for request_id in processed.stopped_ids:
                        engine.abort_request(request_id)  # a stop string ended it: free its blocks now
                    for request_id, final in processed.deltas:
                        finals[request_id] = final
                        progress.finished(final)
        finally:
            for req in requests:
                engine.abort_request(req.request_id)  # no-op for finished ones; frees blocks if interrupted
            engine.pop_finished_ids()
        return [(req.request_id, req.prompt_token_ids, req.sampling_params, finals[req.request_id]) for req in requests]

    def _run_in_engine_process(self, prompts: list[Prompt], params_list: list[SamplingParams],
                               pooling: PoolingParams | None, use_tqdm: bool) -> list[Finished]:
        """Submit every prompt to the engine process and wait for their final deltas."""
        client = self._client
        assert client is not None
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if pooling is not None:  # what new_request checks in the caller's thread; the core would end it with an error
            check_dimensions(pooling, self.engine.model_config)
        for ids, params in zip(prompt_ids, params_list):
            self.engine.validate(ids, params)
        request_ids = [f"llm-{next(_request_numbers)}" for _ in prompts]
        # a thread of its own: a stream submitted where an event loop runs (a notebook) is read with `async for`
        with ThreadPoolExecutor(max_workers=1) as pool:
            collecting = pool.submit(_collect, client, request_ids, prompt_ids, params_list, pooling, use_tqdm)
            try:
                finals = collecting.result()
            except BaseException:
                for request_id in request_ids:
                    client.abort(request_id)  # ends their streams, so the collecting thread returns too
                raise
        return list(zip(request_ids, prompt_ids, params_list, finals))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True) -> list[CompletionOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} messages) or to each
        of a list of them, templated with the model's chat template; one output per conversation.
        chat_template_kwargs are extra template variables (e.g. enable_thinking). With a reasoning
        parser, each output's reasoning is in .reasoning and its text is the answer alone."""
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        template_kwargs = {"add_generation_prompt": add_generation_prompt, **(chat_template_kwargs or {})}
        prompts = [self.tokenizer.apply_chat_template(list(c), **template_kwargs) for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        if self.think_tags is not None:  # the reasoning apart, text the answer alone
            for prompt, out in zip(prompts, outputs):
                out.reasoning, answer = self.think_tags.parser(prompt, self.tokenizer).parse(out.text, out.token_ids)
                out.text = answer or ""
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses: the model's generation-config defaults (vLLM's name)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def kv_cache_stats(self) -> dict[str, int]:
        """The block manager's counters (in an engine process: as its last output reported them)."""
        if self._client is None:
            return self.engine.kv_cache_stats()
        stats = self._client.stats()
        return {key: stats[f"kv_{key}"] for key in ("used_blocks", "free_blocks", "total_blocks")} | {
            key: stats[key] for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block no request uses (vLLM's name): the next prompts compute in full."""
        if self._client is not None:
            self._client.reset_prefix_cache()
        else:
            self.engine.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine process, or the tensor-parallel worker processes, now (else when the LLM is
        garbage collected, or at exit); a no-op without either."""
        if self._client is not None:
            self._client.shutdown()
        else:
            self.engine.shutdown()

    def speculative_stats(self) -> dict[str, float]:
        if self._client is None:
            return self.engine.speculative_stats()
        stats = self._client.stats()
        return {key: stats[key] for key in SpecStats().as_dict()}

    def apply_chat_template(self, messages: Conversation, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **template_kwargs)


_request_numbers = itertools.count()


def _collect(client: EngineProcessClient, request_ids: list[str], prompt_ids: list[list[int]],
             params_list: list[SamplingParams], pooling: PoolingParams | None, use_tqdm: bool) -> list[StreamDelta]:
    """Submit the requests and read each one's final delta; an engine failure raises."""
    streams = [client.submit(ids, params, request_id, pooling_params=pooling, final_only=True)
               for request_id, ids, params in zip(request_ids, prompt_ids, params_list)]
    finals = []
    with _Progress(len(streams), use_tqdm) as progress:
        for stream in streams:
            final = stream.get()
            if final.error is not None and final.error_status >= 500:
                raise RuntimeError(f"request {stream.request_id} failed: {final.error}")
            progress.finished(final)
            finals.append(final)
    return finals


def _prompt_list(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """One prompt (a string or a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _completion(request_id: str, prompt_ids: list[int], params: SamplingParams, final: StreamDelta) -> CompletionOutput:
    times = final.times
    metrics = {"arrival": times.arrival, "admitted": times.admitted or 0.0, "first_token": times.first_token or 0.0,
               "finished": times.finished or final.timestamp, "num_preemptions": times.num_preemptions} if times else {}
    return CompletionOutput(
        request_id=request_id, prompt_token_ids=prompt_ids, token_ids=final.token_ids, text=final.text,
        finish_reason=final.finish_reason, logprobs=final.logprobs if params.logprobs is not None else None,
        prompt_logprobs=final.prompt_logprobs if params.prompt_logprobs is not None else None,
        num_cached_tokens=final.num_cached_tokens, metrics=metrics, stop_reason=final.stop_reason, error=final.error)


class _Progress:
    """vLLM's progress bar: finished requests, and the input / output tokens per second so far."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not enabled,
                        postfix=_speeds(0.0, 0.0))
        self.input_tokens = 0
        self.output_tokens = 0

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def finished(self, final: StreamDelta) -> None:
        if self.bar.disable:
            return
        self.input_tokens += final.num_prompt_tokens
        self.output_tokens += final.num_output_tokens
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.postfix = _speeds(self.input_tokens / elapsed, self.output_tokens / elapsed)
        self.bar.update(1)


def _speeds(input_per_s: float, output_per_s: float) -> str:
    return f"est. speed input: {input_per_s:.2f} toks/s, output: {output_per_s:.2f} toks/s"
