"""Anthropic's Messages API over the chat path: a /v1/messages request runs as the chat endpoint's
request for the same conversation (messages_protocol.py translates it), through the same
tokenizing, chat template, tool parser, stop strings and engine manager (serving.py), and its
output is written as Anthropic's message, or as its stream of events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from roseinfer.server.messages_protocol import CountTokensRequest, MessagesRequest, chat_request, error_body
from roseinfer.server.protocol import APIError, ChatCompletionRequest
from roseinfer.reasoning import Reasoner
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.server.request_params import check_request, sampling_params
from roseinfer.server.responses import EventStream
from roseinfer.server.reply_parts import split_delta, split_reply
from roseinfer.server.serving import CLIENT_CLOSED, OpenAIServing
from roseinfer.server.tool_calls import plan_tools
from roseinfer.server.tool_parsers import ToolParser


@dataclass
class MessageRun:
    """One /v1/messages request in the engine: what its output is read with."""

    id: str
    stream: RequestStream
    input_tokens: int
    parser: ToolParser | None
    reasoner: Reasoner | None

    def stop_reason(self, finish_reason: str | None, ended_by: str | int | None) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence); `ended_by` is the output's stop string or stop token id."""
        if finish_reason == "length":
            return "max_tokens", None
        if self.parser is not None and self.parser.calls:
            return "tool_use", None
        if isinstance(ended_by, str):
            return "stop_sequence", ended_by
        return "end_turn", None


class AnthropicServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def messages(self, body: MessagesRequest, raw: Request) -> Response:
        run = await self._start(body)
        if body.stream:
            return EventStream(self._events(run), lambda: self.serving.abort_unfinished([run.stream]))
        choice = await self.serving.collect_one(run.stream, raw)
        if choice is None:
            return Response(status_code=CLIENT_CLOSED)
        content: list[dict[str, Any]] = []
        reasoning, text, calls = split_reply(choice.text, choice.token_ids, run.reasoner, run.parser)
        if reasoning:  # Anthropic's thinking block, first; it has no signature to verify
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        # a call max_tokens cut has no input object to give: it is left out (streamed, its partial
        # JSON has already gone out as input_json_delta)
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": arguments}
                    for c in calls if isinstance(arguments := _json_object(c.arguments), dict)]
        stop_reason, stop_sequence = run.stop_reason(choice.finish_reason, choice.stop_reason)
        return JSONResponse({"id": run.id, "type": "message", "role": "assistant", "content": content,
                             "model": self.serving.model_name, "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": run.input_tokens, "output_tokens": choice.num_output_tokens}})

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt's length as /v1/messages would template it (tools shown as they would be)."""
        serving = self.serving
        serving.check_model(body.model)
        chat = await serving.run_blocking(_chat_request, body)
        tools = await serving.run_blocking(plan_tools, chat, serving.tool_parser, False)
        return {"input_tokens": len(await serving.chat_prompt(chat.messages, tools.shown))}

    async def _start(self, body: MessagesRequest) -> MessageRun:
        """The chat path's steps for the translated request, up to its submitted engine request."""
        start = time.perf_counter()
        serving = self.serving
        serving.check_model(body.model)
        chat = await serving.run_blocking(_chat_request, body)
        check_request(chat, 1, serving.max_sequences, serving.manager.max_inflight_requests)
        tools = await serving.run_blocking(plan_tools, chat, serving.tool_parser, False)
        ids = await serving.chat_prompt(chat.messages, tools.shown)
        reasoner = serving.reasoning_parser(ids)
        constraint = serving.answer_constraint(ids, tools.constraint)
        grammar = await serving.compile_constraint(constraint)
        params = sampling_params(chat, serving.defaults, body.max_tokens, None, None,
                                 constraint.params if constraint else None)
        [stream] = serving.submit([ids], chat, params, start, grammar)
        return MessageRun(f"msg_{uuid.uuid4().hex}", stream, len(ids),
                          tools.parser() if tools.parser else None, reasoner)

    async def _events(self, run: MessageRun) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start, then each content block as start, deltas and
        stop (reasoning as thinking_delta, text as text_delta, a tool call's arguments as
        input_json_delta), then message_delta
        with the stop reason and usage, and message_stop; an engine error ends it with an error event."""
        yield event("message_start", {"message": {
            "id": run.id, "type": "message", "role": "assistant", "content": [], "model": self.serving.model_name,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": run.input_tokens, "output_tokens": 0}}})
        yield event("ping", {})
        blocks = Blocks()
        async for batch in self.serving.merge_streams([run.stream]):
            for _, delta in batch:
                if delta.error:
                    yield event("error", error_body(delta.error_status, delta.error))
                    return
                reasoning, content, calls = split_delta(delta, run.reasoner, run.parser)
                lines = blocks.text(reasoning, "thinking") + blocks.text(content)
                for call in calls:
                    lines += blocks.tool_call(call)
                for line in lines:
                    yield line
                if delta.finished:
                    for line in blocks.close():
                        yield line
                    stop_reason, stop_sequence = run.stop_reason(delta.finish_reason, delta.stop_reason)
                    yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                                  "usage": {"output_tokens": delta.num_output_tokens}})
        yield event("message_stop", {})


@dataclass
class Blocks:
    """The content blocks of a streamed message: which one is open, and the events each delta makes."""

    index: int = -1
    open: str | None = None  # "thinking" | "text" | "tool_use"
    calls: dict[int, int] = field(default_factory=dict)  # the parser's call index -> block index

    def text(self, text: str, kind: str = "text") -> list[str]:
        """Text of a "text" or "thinking" block, opened when it is not the open one."""
        if not text or (self.open != kind and not text.strip()):  # no block of whitespace between calls
            return []
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        out = [] if self.open == kind else self._start(block)
        return out + [event("content_block_delta", {"index": self.index,
                                                    "delta": {"type": f"{kind}_delta", kind: text}})]

    def tool_call(self, entry: dict[str, Any]) -> list[str]:
        """One of the parser's OpenAI delta.tool_calls entries: a call's id and name first, then its arguments."""
        out = []
        if "id" in entry:
            out = self._start({"type": "tool_use", "id": entry["id"], "name": entry["function"]["name"], "input": {}})
            self.calls[entry["index"]] = self.index
        arguments = entry["function"].get("arguments")
        if arguments:
            out.append(event("content_block_delta", {"index": self.calls[entry["index"]], "delta": {
                "type": "input_json_delta", "partial_json": arguments}}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]


def event(kind: str, data: dict[str, Any]) -> str:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


def _json_object(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return None


def _chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    try:
        return chat_request(body)
    except ValidationError as exc:  # a rule of the chat path's messages (a tool result's id, ...)
        first = exc.errors(include_url=False)[0]
        raise APIError(400, f"messages: {first['msg']}", "messages") from None
