"""The OpenAI completions and chat APIs over a SchedulerManager: requests in, JSON or SSE out.

Everything here runs on the HTTP event loop and never waits on a forward pass: it tokenizes,
submits, and awaits deltas the engine worker pushes. A request is aborted in the engine as
soon as its client is gone, streamed or not, so its KV blocks free at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from roseinfer.engine.request import TokenLogprobs
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.engine_loop import OverloadedError, RequestStream, SchedulerManager, StreamDelta
from roseinfer.server.logprobs import Entry, LogprobsFormatter
from roseinfer.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       SamplingRequest, error_body)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit: one HTTP request must not flood the engine
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by anyone
RETRY_AFTER_S = "1"


@dataclass
class _Choice:
    """One choice, accumulated for a non-streaming response."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    error: str | None = None


class OpenAIServing:
    def __init__(self, manager: SchedulerManager, model_name: str) -> None:
        engine = manager.engine
        self.manager = manager
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.defaults = engine.sampling_defaults  # the model's generation config, for fields a request leaves unset
        self.logprobs = LogprobsFormatter(engine.tokenizer)
        # what one request can hold: the context, or the whole KV pool if that is smaller
        self.context_limit = min(engine.max_model_len, engine.num_kv_blocks * engine.config.block_size)

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        start = time.perf_counter()
        self.check_model(body.model)
        _check_num_logprobs(body, "logprobs")
        _check_prompt_logprobs(body)
        # echo with logprobs: the prompt tokens' logprobs come first, as OpenAI's legacy API gave
        # them (lm-evaluation-harness scores continuations so); max_tokens 0 then returns only
        # the prompt: one token is generated and dropped, as vLLM does
        echo_logprobs = body.echo and body.logprobs is not None
        prompt_only = body.echo and body.max_tokens == 0
        prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0) if echo_logprobs else body.prompt_logprobs
        prompts = self._completion_prompts(body.prompt)
        max_tokens = self.defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS) if body.max_tokens is None \
            else body.max_tokens
        params = self._sampling_params(body, 1 if prompt_only else max_tokens, body.logprobs, prompt_logprobs)
        streams = self._submit([ids for ids, _ in prompts], body, params, start)
        echoes = [(text if text is not None else self.tokenizer.decode(ids)) if body.echo else ""
                  for ids, text in prompts for _ in range(body.n)]
        prompt_ids = [ids if echo_logprobs else [] for ids, _ in prompts for _ in range(body.n)]
        reply = _Reply(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, "text_completion",
                       [len(ids) for ids, _ in prompts], body.include_usage)
        if body.stream:
            return _EventStream(self._stream_completion(streams, reply, echoes, prompt_ids, body.logprobs, prompt_only),
                                lambda: self.abort_unfinished(streams))
        choices = await self._collect(streams, raw, prompt_only)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "text": echoes[i] + c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.logprobs is not None:
                entries = _prompt_entries(prompt_ids[i], c.prompt_logprobs) + [(lp.token_id, lp) for lp in c.logprobs]
                choice["logprobs"] = self.logprobs.completion(entries, 0, body.logprobs)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs or [], body.prompt_logprobs)
            out.append(choice)
        return JSONResponse(reply.body(out, choices))

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        start = time.perf_counter()
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        _check_num_logprobs(body, "top_logprobs")
        _check_prompt_logprobs(body)
        ids = self.chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's chat default: whatever room the context has left
            max_tokens = min(max(1, self.context_limit - len(ids)), self.defaults.get("max_tokens", self.context_limit))
        params = self._sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                       body.prompt_logprobs)
        streams = self._submit([ids], body, params, start)
        reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, "chat.completion",
                       [len(ids)], body.include_usage)
        if body.stream:
            return _EventStream(self._stream_chat(streams, reply, body.logprobs), lambda: self.abort_unfinished(streams))
        choices = await self._collect(streams, raw)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        response = reply.body([{
            "index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
            "logprobs": self.logprobs.chat(c.logprobs) if body.logprobs else None,
        } for i, c in enumerate(choices)], choices)
        if body.prompt_logprobs is not None:  # vLLM's: one prompt, so once per response
            response["prompt_logprobs"] = self.logprobs.prompt(choices[0].prompt_logprobs or [], body.prompt_logprobs)
        return JSONResponse(response)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        try:
            return self.tokenizer.apply_chat_template([m.to_template() for m in messages])
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", "messages") from None

    # ---- request -> engine -------------------------------------------------------------------
    def _completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """(token ids, original text or None) per prompt; the four shapes OpenAI accepts."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        return [(self.tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompt]

    def _sampling_params(self, body: SamplingRequest, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
            bias[int(key)] = value
        values = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                  "seed": body.seed, "presence_penalty": body.presence_penalty,
                  "frequency_penalty": body.frequency_penalty, "logit_bias": bias, "top_k": body.top_k,
                  "min_p": body.min_p, "repetition_penalty": body.repetition_penalty, "ignore_eos": body.ignore_eos,
                  "min_tokens": body.min_tokens, "stop_token_ids": body.stop_token_ids, "logprobs": logprobs,
                  "prompt_logprobs": prompt_logprobs}
        try:
            return SamplingParams(**{**self.defaults, **{k: v for k, v in values.items() if v is not None}})
        except ValueError as exc:
            raise _bad_value(exc, body) from None

    def _submit(self, prompts: list[list[int]], body: SamplingRequest, params: SamplingParams,
                start: float) -> list[RequestStream]:
        """n engine requests per prompt; with a seed, choice i draws from seed + i."""
        if not 1 <= body.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {body.n}", "n")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        base_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                for i in range(body.n):
                    choice_params = params if params.seed is None or i == 0 else \
                        dataclasses.replace(params, seed=params.seed + i)
                    streams.append(self.manager.submit(ids, choice_params, f"{base_id}-{len(streams)}", stop, start))
        except BaseException as exc:
            for stream in streams:  # all or nothing: no half-submitted choice sets
                self.manager.abort(stream.request_id)
            if isinstance(exc, OverloadedError):
                raise APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": RETRY_AFTER_S}) from None
            if isinstance(exc, ValueError):
                raise _bad_value(exc, body) from None
            if isinstance(exc, RuntimeError):
                raise APIError(503, "the server is shutting down") from None
            raise
        return streams

    # ---- engine -> response ------------------------------------------------------------------
    async def _stream_completion(self, streams: list[RequestStream], reply: "_Reply", echoes: list[str],
                                 prompt_ids: list[list[int]], num_logprobs: int | None,
                                 prompt_only: bool) -> AsyncIterator[str]:
        """The first chunk of each choice carries the echoed prompt (and its tokens' logprobs)."""
        offsets = [0] * len(echoes)  # text_offset of the next token, per choice
        echoed = [False] * len(echoes)
        async for index, delta in self._merge(streams):
            if prompt_only:
                delta = _without_output(delta)
            text, entries = delta.text, [(lp.token_id, lp) for lp in delta.logprobs]
            if not echoed[index]:
                text, echoed[index] = echoes[index] + text, True
                entries = _prompt_entries(prompt_ids[index], delta.prompt_logprobs) + entries
            logprobs = self.logprobs.completion(entries, offsets[index], num_logprobs) if num_logprobs is not None else None
            if logprobs is not None and logprobs["tokens"]:
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if delta.error:
                yield _sse(error_body(500, delta.error))
            elif text or delta.finished or (logprobs is not None and logprobs["tokens"]):
                yield _sse(reply.chunk({"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": delta.finish_reason}))
            reply.record(index, delta)
        for line in reply.tail():
            yield line

    async def _stream_chat(self, streams: list[RequestStream], reply: "_Reply", want_logprobs: bool
                           ) -> AsyncIterator[str]:
        for index in range(len(streams)):  # OpenAI's first chunk per choice names the role
            yield _sse(reply.chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}))
        async for index, delta in self._merge(streams):
            logprobs = self.logprobs.chat(delta.logprobs) if want_logprobs and delta.logprobs else None
            if delta.error:
                yield _sse(error_body(500, delta.error))
            elif delta.text or delta.finished or logprobs:
                yield _sse(reply.chunk({"index": index, "delta": {"content": delta.text} if delta.text else {},
                                        "logprobs": logprobs, "finish_reason": delta.finish_reason}))
            reply.record(index, delta)
        for line in reply.tail():
            yield line

    async def _merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) from all streams as they come."""
        tasks: list[asyncio.Task] = []
        try:
            if len(streams) == 1:
                async for delta in streams[0]:
                    yield 0, delta
                return
            merged: asyncio.Queue[tuple[int, StreamDelta]] = asyncio.Queue()

            async def pump(index: int, stream: RequestStream) -> None:
                async for delta in stream:
                    merged.put_nowait((index, delta))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            remaining = len(streams)
            while remaining:
                index, delta = await merged.get()
                remaining -= delta.finished
                yield index, delta
        finally:
            for task in tasks:
                task.cancel()

    async def _collect(self, streams: list[RequestStream], raw: Request,
                       prompt_only: bool = False) -> list[_Choice] | None:
        """Run a non-streaming request to the end; None if the client went away first."""
        choices = [_Choice() for _ in streams]

        async def gather() -> None:
            async for index, delta in self._merge(streams):
                if prompt_only:
                    delta = _without_output(delta)
                c = choices[index]
                c.text += delta.text
                c.logprobs += delta.logprobs
                if delta.prompt_logprobs is not None:
                    c.prompt_logprobs = delta.prompt_logprobs
                c.num_output_tokens = delta.num_output_tokens
                c.finish_reason, c.error = delta.finish_reason, delta.error

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            watch.cancel()
            work.cancel()
            self.abort_unfinished(streams)
        if work not in done:
            return None
        work.result()  # a bug in gather surfaces as a 500, not as a silent disconnect
        return choices

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.manager.abort(stream.request_id)


@dataclass
class _Reply:
    """What every response or chunk of one HTTP request shares, and its usage so far."""

    id: str
    created: int
    model: str
    object: str  # "text_completion" | "chat.completion"
    prompt_lens: list[int]  # one per prompt, counted once however many choices (OpenAI's usage)
    include_usage: bool
    completion_tokens: dict[int, int] = field(default_factory=dict)  # per choice, totals

    def record(self, index: int, delta: StreamDelta) -> None:
        self.completion_tokens[index] = delta.num_output_tokens

    def usage(self) -> dict[str, int]:
        prompt, completion = sum(self.prompt_lens), sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, stream: bool) -> dict[str, Any]:
        suffix = ".chunk" if stream and self.object == "chat.completion" else ""
        return {"id": self.id, "object": self.object + suffix, "created": self.created, "model": self.model}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(stream=True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def tail(self) -> list[str]:
        """The usage chunk (when asked for) and the end marker."""
        usage = [_sse({**self._head(stream=True), "choices": [], "usage": self.usage()})] if self.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    def body(self, choices: list[dict[str, Any]], results: list[_Choice]) -> dict[str, Any]:
        failed = next((r.error for r in results if r.error), None)
        if failed:
            raise APIError(500, failed)
        for i, r in enumerate(results):
            self.completion_tokens[i] = r.num_output_tokens
        return {**self._head(stream=False), "choices": choices, "usage": self.usage()}


def _check_num_logprobs(body: SamplingRequest, name: str) -> None:
    value = getattr(body, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be between 0 and {MAX_LOGPROBS}", name)


def _check_prompt_logprobs(body: SamplingRequest) -> None:
    _check_num_logprobs(body, "prompt_logprobs")
    if body.prompt_logprobs is not None and body.stream:  # as in vLLM
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _prompt_entries(prompt_ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> list[Entry]:
    """The prompt's tokens with their logprobs (empty when the prompt is not echoed with them)."""
    return list(zip(prompt_ids, logprobs or []))


def _without_output(delta: StreamDelta) -> StreamDelta:
    """An echo request with max_tokens 0: the generated token is dropped, and it ends for length."""
    reason = "length" if delta.finish_reason in ("stop", "length") else delta.finish_reason
    return dataclasses.replace(delta, text="", token_ids=[], logprobs=[], num_output_tokens=0, finish_reason=reason)


def _bad_value(exc: ValueError, body: SamplingRequest) -> APIError:
    """400 with `param` set to the first request field the message names."""
    message = str(exc)
    param = next((w for w in re.findall(r"[a-z_]+", message) if w in type(body).model_fields), None)
    return APIError(400, message, param)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the response ends: done, client gone (Starlette
    cancels the send loop, possibly while our generator sits at a yield and so never sees it),
    or server shutdown. That is where unfinished requests are aborted, deterministically."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _wait_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect (when the client leaves).
    while (await raw.receive())["type"] != "http.disconnect":
        pass
