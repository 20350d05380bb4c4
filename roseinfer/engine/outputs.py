"""What crosses the engine core's boundary: plain data (ints, floats, strings, lists), no tensors and
no Request. msgspec structs, encoded as arrays without field names, so that an engine process sends a
step's outputs as they are (engine_client/messages.py)."""
from __future__ import annotations

import msgspec

from roseinfer.engine.request import Request, TokenLogprobs


class RequestTimes(msgspec.Struct, array_like=True, gc=False):
    """A request's timestamps (time.perf_counter()) as the core saw them."""

    arrival: float
    admitted: float | None  # first scheduled
    first_token: float | None
    finished: float | None = None
    token_times: list[float] = msgspec.field(default_factory=list)  # one per output token
    num_preemptions: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step produced for one request: a delta, never the whole history, and no text."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    new_logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)  # one per new token, when asked for
    # with prompt_logprobs, on the output that carries the first token: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why the core ended the request early (finish_reason "abort")
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # on the output that carries the first token and on the final one
    times: RequestTimes | None = None
    stop_reason: int | None = None  # the stop_token_ids entry that ended it (not an EOS)
    embedding: list[float] | None = None  # an embedding request's pooled vector, on its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_times(req: Request) -> RequestTimes:
    return RequestTimes(req.arrival_time, req.admitted_time, req.first_token_time, req.finished_time,
                        list(req.token_times), req.num_preemptions)


def aborted_output(req: Request) -> EngineCoreOutput:
    """The final output of a request the core ended outside a step (an abort)."""
    return EngineCoreOutput(req.request_id, [], "abort", error=req.error, num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens, times=request_times(req))
