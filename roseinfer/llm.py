"""LLM: the offline API (vLLM's shape) over LLMEngine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.request import Request, TokenLogprobs
from roseinfer.output_processor import OutputProcessor, StreamDelta
from roseinfer.pooling_params import PoolingParams
from roseinfer.reasoning import pick_reasoning_parser
from roseinfer.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


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
        "auto", "qwen3" or "deepseek_r1"."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
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
        requests = [self.engine.new_request(prompt, params) for prompt, params in zip(prompts, params_list)]
        finals = self._run(requests, use_tqdm)
        return [_completion(req.request_id, req.prompt_token_ids, req.sampling_params, finals[req.request_id])
                for req in requests]

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's final hidden state pooled into one vector, in order; vLLM's shape. Without
        PoolingParams, the checkpoint's sentence-transformers pooling, else the last token's, normalized."""
        params = pooling_params or self.engine.pooling_defaults
        requests = [self.engine.new_request(prompt, pooling_params=params) for prompt in _prompt_list(prompts)]
        finals = self._run(requests, use_tqdm)
        return [EmbeddingRequestOutput(req.request_id, req.prompt_token_ids,
                                       EmbeddingOutput(finals[req.request_id].embedding or []))
                for req in requests]

    def _run(self, requests: list[Request], use_tqdm: bool) -> dict[str, StreamDelta]:
        """Step the engine until every request is done; their final deltas by request id."""
        engine = self.engine
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
        return finals

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
        return self.engine.default_sampling_params()

    def kv_cache_stats(self) -> dict[str, int]:
        return self.engine.kv_cache_stats()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (else when the LLM is garbage
        collected, or at exit); a no-op without tensor parallelism."""
        self.engine.shutdown()

    def speculative_stats(self) -> dict[str, float]:
        return self.engine.speculative_stats()

    def apply_chat_template(self, messages: Conversation, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **template_kwargs)


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
        num_cached_tokens=final.num_cached_tokens, metrics=metrics, stop_reason=final.stop_reason)


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
