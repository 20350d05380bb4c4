"""From a validated request body to what the engine takes: SamplingParams (the model's defaults
under the request's own fields) and the checks that span several fields or the server's limits.
Single-field ranges are the request models' (protocol.py)."""
from __future__ import annotations

import re
from typing import Any

from roseinfer.sampling_params import SEED_MAX, RequestOutputKind, SamplingParams, StructuredOutputsParams
from roseinfer.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest


def check_sequences(num_prompts: int, n: int, max_sequences: int) -> None:
    sequences = num_prompts * n
    if sequences > max_sequences:
        raise APIError(400, f"{num_prompts} prompt(s) x n={n} = {sequences} sequences; this server takes at "
                            f"most {max_sequences} per request (--max-sequences-per-request)", "n" if n > 1 else "prompt")


def check_request(body: SamplingRequest, num_prompts: int, max_sequences: int, max_inflight: int | None) -> None:
    check_sequences(num_prompts, body.n, max_sequences)
    sequences = num_prompts * body.n
    param = "n" if body.n > 1 else "prompt"
    if max_inflight is not None and sequences > max_inflight:
        # a 429 here would send clients that honour Retry-After round forever: it can never fit
        raise APIError(400, f"{sequences} sequences in one request can never run: the server holds at most "
                            f"{max_inflight} in flight (--max-inflight-requests)", param)
    if body.seed is not None and body.seed + body.n - 1 > SEED_MAX:
        raise APIError(400, f"seed + n - 1 must be <= {SEED_MAX} (choice i samples with seed + i)", "seed")
    if body.prompt_logprobs is not None and body.stream:  # as in vLLM
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")


def check_completion_fields(body: CompletionRequest) -> None:
    """Fields taken only in the values that ask for nothing roseinfer lacks."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of must equal n ({body.n}): generating more candidates than are returned and "
                            "ranking them is not supported", "best_of")


def check_chat_fields(body: ChatCompletionRequest) -> None:
    if body.modalities is not None and "audio" in body.modalities:
        raise APIError(400, "audio output is not supported (text models only): modalities may only be ['text']",
                       "modalities")
    if body.store:
        raise APIError(400, "store must be false: roseinfer keeps no completions", "store")


def sampling_params(body: SamplingRequest, defaults: dict[str, Any], max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    values = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
              "seed": body.seed, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty,
              "logit_bias": {int(key): value for key, value in (body.logit_bias or {}).items()},
              "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
              "ignore_eos": body.ignore_eos, "min_tokens": body.min_tokens, "stop_token_ids": body.stop_token_ids,
              "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
              "include_stop_str_in_output": body.include_stop_str_in_output,
              "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "structured_outputs": structured_outputs,
              # a response sent whole needs no text before the end, nor a delta per token
              "output_kind": RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY}
    try:
        return SamplingParams(**{**defaults, **{k: v for k, v in values.items() if v is not None}})
    except ValueError as exc:
        raise bad_value(exc, body) from None


def bad_value(exc: ValueError, body: SamplingRequest) -> APIError:
    """400 with `param` set to the first request field the message names."""
    message = str(exc)
    param = next((w for w in re.findall(r"[a-z_]+", message) if w in type(body).model_fields), None)
    return APIError(400, message, param)
