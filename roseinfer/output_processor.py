"""OutputProcessor: the client side of the engine core. It turns the core's plain outputs (token ids,
logprobs, finish reasons, timestamps) into text deltas: incremental detokenization, stop strings
(held back while they may still begin, cut where they match; the core is then told to abort the
request), and flushes every `stream_interval` tokens (the first at once). The server's worker and
the offline LLM use it alike."""
from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.engine.outputs import EngineCoreOutput, RequestTimes
from roseinfer.engine.request import TokenLogprobs
from roseinfer.sampling_params import RequestOutputKind, SamplingParams
from roseinfer.stop_strings import StopStringMatcher
from roseinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class StreamDelta:
    """One flush of a request's output."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token in token_ids, when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int  # totals so far, including tokens whose text a stop string cut
    timestamp: float  # time.perf_counter() when it was flushed
    error: str | None = None  # the engine failed this request (finish_reason is then "abort")
    # the HTTP status that error maps to: 400 the request's fault, 500 the engine's, 503 a shutdown
    error_status: int = 500
    # with prompt_logprobs, in the first delta: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # what ended the output with finish_reason "stop": the stop string or stop token id (None: EOS)
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    times: RequestTimes | None = None  # the core's timestamps, in the first delta and the final one
    embedding: list[float] | None = None  # an embedding request's vector, in its final delta


@dataclass
class _RequestState:
    params: SamplingParams
    num_prompt_tokens: int
    # None when only the final output is read and no stop string needs the text as it grows
    detok: IncrementalDetokenizer | None
    stop: StopStringMatcher | None
    final_only: bool
    text_at_end: bool  # detok decodes every token once, when the request ends: no stop string reads it before
    # produced since the last flush
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    times: RequestTimes | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    flushed: bool = False  # the first token has gone out
    embedding: list[float] | None = None


@dataclass
class ProcessedOutputs:
    deltas: list[tuple[str, StreamDelta]] = field(default_factory=list)  # (request id, delta)
    stopped_ids: list[str] = field(default_factory=list)  # a stop string ended them: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    final_only: bool = False) -> None:
        """final_only: one delta at the end, with everything, its text the output ids decoded alone (the
        offline API's way). params.output_kind FINAL_ONLY: one delta at the end too, its text the one
        the streamed deltas would have made (decoded after the prompt's last tokens)."""
        stop = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if stop is not None or not final_only else None
        whole = params.output_kind is RequestOutputKind.FINAL_ONLY
        self._states[request_id] = _RequestState(params, len(prompt_ids), detok, stop, final_only or whole,
                                                 whole and stop is None and not final_only)

    def has_requests(self) -> bool:
        return bool(self._states)

    def process(self, outputs: list[EngineCoreOutput], now: float) -> ProcessedOutputs:
        """One step's outputs; those of requests already ended here (a stop string) are dropped."""
        result = ProcessedOutputs()
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue
            matched = self._absorb(state, out)
            if matched:
                if not out.finished:
                    result.stopped_ids.append(out.request_id)
                result.deltas.append((out.request_id, self._end(out.request_id, "stop", now, state.stop.matched)))
            elif out.finished:
                # an error the core reports is the request's (e.g. its grammar failed): a 400
                result.deltas.append((out.request_id, self._end(out.request_id, out.finish_reason, now,
                                                                out.stop_reason, out.error, status=400)))
            elif not state.final_only and (not state.flushed or len(state.token_ids) >= self.stream_interval):
                result.deltas.append((out.request_id, self._flush(state, now)))
        return result

    def fail(self, request_id: str, message: str, status: int, now: float,
             aborted: EngineCoreOutput | None = None) -> StreamDelta:
        """End a request the caller gives up on (a failed engine, a shutdown) with an error; `aborted`:
        the core's final output for it, whose timestamps the delta then carries."""
        if aborted is not None and aborted.times is not None:
            self._states[request_id].times = aborted.times
        return self._end(request_id, "abort", now, error=message, status=status)

    def request_ids(self) -> list[str]:
        return list(self._states)

    def _absorb(self, state: _RequestState, out: EngineCoreOutput) -> bool:
        """Take one step's tokens; True if a stop string matched."""
        state.token_ids += out.new_token_ids
        state.logprobs += out.new_logprobs
        state.num_output_tokens += len(out.new_token_ids)
        state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        if out.times is not None:
            state.times = out.times
        state.embedding = out.embedding
        if state.detok is None or state.text_at_end:
            return False
        text = state.detok.add(out.new_token_ids)
        if out.finished:
            text += state.detok.flush()
        matched = False
        if state.stop is not None:
            text, matched = state.stop.add(text, state.num_output_tokens > state.params.min_tokens)
            if out.finished and not matched:
                text += state.stop.flush()
        state.text += text
        return matched

    def _end(self, request_id: str, reason: str | None, now: float, stop_reason: str | int | None = None,
             error: str | None = None, status: int = 500) -> StreamDelta:
        state = self._states.pop(request_id)
        if state.detok is None:
            state.text = self.tokenizer.decode(state.token_ids)
        elif state.text_at_end:
            state.text = state.detok.add(state.token_ids) + state.detok.flush()
        delta = self._flush(state, now, reason, error, status)
        delta.stop_reason = stop_reason
        return delta

    def _flush(self, state: _RequestState, now: float, reason: str | None = None, error: str | None = None,
               status: int = 500) -> StreamDelta:
        finished = reason is not None
        first = not state.flushed
        delta = StreamDelta(state.text, state.token_ids, state.logprobs, finished, reason, state.num_prompt_tokens,
                            state.num_output_tokens, now, error, status, state.prompt_logprobs if first else None,
                            num_cached_tokens=state.num_cached_tokens, times=state.times if first or finished else None,
                            embedding=state.embedding if finished else None)
        state.text, state.token_ids, state.logprobs = "", [], []
        state.flushed = True
        return delta
