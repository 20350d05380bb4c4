"""What the completions and chat endpoints send back: the parts every response or chunk of one
request shares (and its usage), the choices a non-streaming request accumulates, SSE framing."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from roseinfer.engine.request import TokenLogprobs
from roseinfer.output_processor import StreamDelta
from roseinfer.server.logprobs import Entry
from roseinfer.server.protocol import APIError


@dataclass
class Choice:
    """One choice, accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)
    embedding: list[float] | None = None  # an embedding request's vector

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_output_tokens = delta.num_output_tokens
        self.finish_reason, self.error, self.error_status = delta.finish_reason, delta.error, delta.error_status
        self.stop_reason = delta.stop_reason
        self.embedding = delta.embedding


@dataclass
class Reply:
    """What every response or chunk of one HTTP request shares, and its usage so far."""

    id: str
    created: int
    model: str
    object: str  # "text_completion" | "chat.completion"
    prompt_lens: list[int]  # one per prompt, counted once however many choices (OpenAI's usage)
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    completion_tokens: dict[int, int] = field(default_factory=dict)  # per choice, totals
    reasoning_tokens: dict[int, int] | None = None  # per choice, with a reasoning parser (reasoning.py)
    # every chunk of a stream opens and closes the same way: encoded once, around each choice
    _chunk_open: bytes = field(init=False, repr=False)
    _chunk_close: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        head = _json.encode(self._head(stream=True))
        self._chunk_open = b"data: " + head[:-1] + b',"choices":['
        self._chunk_close = b']' + (b',"usage":null' if self.include_usage else b"") + b"}\n\n"

    def record(self, index: int, delta: StreamDelta) -> None:
        self.completion_tokens[index] = delta.num_output_tokens

    def usage(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt_lens), sum(self.completion_tokens.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens.values())}
        return usage

    def _head(self, stream: bool) -> dict[str, Any]:
        suffix = ".chunk" if stream and self.object == "chat.completion" else ""
        return {"id": self.id, "object": self.object + suffix, "created": self.created, "model": self.model}

    def chunk(self, choice: dict[str, Any]) -> bytes:
        """One SSE event of a stream, carrying one choice."""
        if self.include_usage and self.continuous_usage:
            return self._chunk_open + _json.encode(choice) + b'],"usage":' + _json.encode(self.usage()) + b"}\n\n"
        return self._chunk_open + _json.encode(choice) + self._chunk_close

    def tail(self) -> list[bytes]:
        """The usage chunk (when asked for) and the end marker."""
        usage = [sse({**self._head(stream=True), "choices": [], "usage": self.usage()})] if self.include_usage else []
        return usage + [b"data: [DONE]\n\n"]

    def body(self, choices: list[dict[str, Any]], results: list[Choice]) -> dict[str, Any]:
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            raise APIError(failed.error_status, failed.error)
        for i, r in enumerate(results):
            self.completion_tokens[i] = r.num_output_tokens
        return {**self._head(stream=False), "choices": choices, "usage": self.usage()}


def prompt_entries(prompt_ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> list[Entry]:
    """The prompt's tokens with their logprobs (empty when the prompt is not echoed with them)."""
    return list(zip(prompt_ids, logprobs or []))


def without_output(delta: StreamDelta) -> StreamDelta:
    """An echo request with max_tokens 0: the generated token is dropped, and it ends for length."""
    reason = "length" if delta.finish_reason in ("stop", "length") else delta.finish_reason
    return dataclasses.replace(delta, text="", token_ids=[], logprobs=[], num_output_tokens=0, finish_reason=reason)


_json = msgspec.json.Encoder()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the response ends: done, client gone (Starlette
    cancels the send loop, possibly while our generator sits at a yield and so never sees it),
    or server shutdown. That is where unfinished requests are aborted, deterministically."""

    def __init__(self, events: AsyncIterator[str] | AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def wait_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect (when the client leaves).
    while (await raw.receive())["type"] != "http.disconnect":
        pass
