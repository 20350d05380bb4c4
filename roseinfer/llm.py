"""LLM: the offline API (vLLM's shape) over LLMEngine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.request import TokenLogprobs
from roseinfer.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts (strings or token-id lists, mixed is fine) to completion, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        engine = self.engine
        ids: list[str] = []
        requests = {}
        try:
            # add_request validates; if a later prompt is bad, the finally below withdraws the
            # ones already submitted, so a failed call leaves nothing behind
            for prompt, params in zip(prompts, params_list):
                rid = engine.add_request(prompt, params)
                ids.append(rid)
                requests[rid] = engine.get_request(rid)
            while engine.has_unfinished():
                engine.step()
        finally:
            for rid in ids:
                engine.abort_request(rid)  # no-op for finished ones; frees blocks if interrupted
            engine.pop_finished_ids()
        return [self._output(requests[rid]) for rid in ids]

    def _output(self, req) -> CompletionOutput:
        out_ids = req.output_token_ids
        metrics = {"arrival": req.arrival_time, "admitted": req.admitted_time or 0.0,
                   "first_token": req.first_token_time or 0.0, "finished": req.finished_time or 0.0,
                   "num_preemptions": req.num_preemptions}
        return CompletionOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=out_ids,
            text=self.tokenizer.decode(out_ids), finish_reason=req.finish_reason,
            logprobs=req.logprobs if req.sampling_params.logprobs is not None else None,
            num_cached_tokens=req.num_cached_tokens, metrics=metrics)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses: the model's generation-config defaults (vLLM's name)."""
        return self.engine.default_sampling_params()

    def kv_cache_stats(self) -> dict[str, int]:
        return self.engine.kv_cache_stats()

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)
