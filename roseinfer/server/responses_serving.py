"""OpenAI's Responses API over the chat path: a /v1/responses request runs as the chat endpoint's
request for the same conversation (responses_protocol.py translates it), through the same
template, tools, structured output, reasoning parser and engine manager (serving.py), and its
output is written as a Response object of output items (reasoning, message, function_call), or as
the Responses event stream (response.created ... response.completed). A response asked to be stored
is kept once it is done (responses_store.py); one that continues a stored response runs with that
conversation before its input."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from roseinfer.server.protocol import APIError, ChatCompletionRequest
from roseinfer.reasoning import Reasoner
from roseinfer.server.request_params import check_chat_fields, check_request, sampling_params
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.server.responses import EventStream
from roseinfer.server.responses_protocol import ResponsesRequest, chat_request, input_items
from roseinfer.server.responses_store import RESPONSE_NOT_FOUND, ResponseStore, StoredResponse
from roseinfer.server.reply_parts import split_delta, split_reply
from roseinfer.server.serving import CLIENT_CLOSED, OpenAIServing
from roseinfer.server.structured import requested_constraint
from roseinfer.server.tool_calls import plan_tools
from roseinfer.server.tool_parsers import ToolParser


@dataclass
class ResponseRun:
    """One /v1/responses request in the engine: what its output is read with, and what the
    Response object echoes of the request."""

    id: str
    created_at: int
    stream: RequestStream
    input_tokens: int
    parser: ToolParser | None
    reasoner: Reasoner | None
    echoed: dict[str, Any]
    stored_input: list[dict[str, Any]] | None  # its input items when it is to be stored, else None
    earlier: StoredResponse | None  # the stored response it continues

    def response(self, status: str, output: list[dict[str, Any]], output_tokens: int | None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        usage = None if output_tokens is None else {
            "input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoner.reasoning_tokens if self.reasoner else 0},
            "total_tokens": self.input_tokens + output_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete else status, "error": None, "incomplete_details": incomplete,
                "output": output, "usage": usage, **self.echoed}


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def responses(self, body: ResponsesRequest, raw: Request) -> Response:
        run = await self._start(body)
        if body.stream:
            return EventStream(self._events(run), lambda: self.serving.abort_unfinished([run.stream]))
        choice = await self.serving.collect_one(run.stream, raw)
        if choice is None:
            return Response(status_code=CLIENT_CLOSED)
        reasoning, text, calls = split_reply(choice.text, choice.token_ids, run.reasoner, run.parser)
        output = []
        if reasoning:
            output.append(reasoning_item(reasoning))
        if text:
            output.append(message_item(text))
        output += [function_call_item(c.id, c.name, c.arguments) for c in calls]
        return JSONResponse(self._done(run, run.response("completed", output, choice.num_output_tokens,
                                                         choice.finish_reason)))

    def stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or the 404 that names its id."""
        entry = self.store.get(response_id)
        if entry is None:
            which = "Previous response" if param == "previous_response_id" else "Response"
            raise APIError(404, f"{which} with id '{response_id}' not found: it was never stored, or was evicted "
                                "(--responses-store-size, --responses-store-mb) or deleted", param,
                           RESPONSE_NOT_FOUND)
        return entry

    def _kept(self, body: ResponsesRequest) -> bool:
        """Whether this response is to be stored: unless store is false, when the server keeps any."""
        if self.store.enabled:
            return body.store is not False
        for param in ("store", "previous_response_id"):
            if getattr(body, param):
                raise APIError(400, f"{param}: responses are not stored on this server (--responses-store-size 0): "
                                    "send the whole conversation in input", param)
        return False

    def _done(self, run: ResponseRun, response: dict[str, Any]) -> dict[str, Any]:
        """A finished response, stored when it was asked to be."""
        if run.stored_input is not None:
            self.store.put(run.id, StoredResponse.of(response, run.stored_input, run.earlier))
        return response

    async def _start(self, body: ResponsesRequest) -> ResponseRun:
        """The chat path's steps for the translated request, up to its submitted engine request."""
        start = time.perf_counter()
        serving = self.serving
        serving.check_model(body.model)
        kept = self._kept(body)
        earlier = None
        if body.previous_response_id is not None:
            earlier = self.stored(body.previous_response_id, "previous_response_id")
        chat = await serving.run_blocking(_chat_request, body, earlier.conversation if earlier else ())
        stored_input = await serving.run_blocking(input_items, body) if kept else None
        check_request(chat, 1, serving.max_sequences, serving.manager.max_inflight_requests)
        check_chat_fields(chat)
        constraint = await serving.run_blocking(requested_constraint, chat, serving.constraint_limits.max_bytes)
        tools = await serving.run_blocking(plan_tools, chat, serving.tool_parser, constraint is not None)
        constraint = constraint or tools.constraint
        ids = await serving.chat_prompt(chat.messages, tools.shown)
        reasoner = serving.reasoning_parser(ids)
        constraint = serving.answer_constraint(ids, constraint)
        grammar = await serving.compile_constraint(constraint)
        max_tokens = chat.max_tokens if chat.max_tokens is not None else \
            min(max(1, serving.context_limit - len(ids)), serving.defaults.get("max_tokens", serving.context_limit))
        params = sampling_params(chat, serving.defaults, max_tokens, None, None,
                                 constraint.params if constraint else None)
        [stream] = serving.submit([ids], chat, params, start, grammar)
        echoed = {"model": serving.model_name, "instructions": body.instructions,
                  "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                  "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
                  "store": kept, "temperature": params.temperature, "top_p": params.top_p,
                  "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                      if body.text is not None and body.text.format is not None else {"type": "text"})},
                  "tool_choice": _tool_choice(body),
                  "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled"}
        return ResponseRun(f"resp_{uuid.uuid4().hex}", int(time.time()), stream, len(ids),
                           tools.parser() if tools.parser else None, reasoner, echoed, stored_input, earlier)

    async def _events(self, run: ResponseRun) -> AsyncIterator[str]:
        """The Responses event sequence: response.created and response.in_progress, then each output
        item as added, its deltas (reasoning_text, output_text, function_call_arguments) and done,
        then response.completed (response.incomplete when max_output_tokens cut it); an engine
        error ends it with an error event."""
        events = Events()
        yield events.emit("response.created", response=run.response("in_progress", [], None))
        yield events.emit("response.in_progress", response=run.response("in_progress", [], None))
        async for batch in self.serving.merge_streams([run.stream]):
            for _, delta in batch:
                if delta.error:
                    yield events.emit("error", code=str(delta.error_status), message=delta.error, param=None)
                    return
                reasoning, content, calls = split_delta(delta, run.reasoner, run.parser)
                lines = events.text(reasoning, "reasoning") + events.text(content, "message")
                for call in calls:
                    lines += events.tool_call(call)
                for line in lines:
                    yield line
                if delta.finished:
                    for line in events.close():
                        yield line
                    response = self._done(run, run.response("completed", events.output, delta.num_output_tokens,
                                                             delta.finish_reason))
                    yield events.emit(f"response.{response['status']}", response=response)


@dataclass
class Events:
    """The output items of a streamed response: which one is open, and the events each delta makes."""

    sequence_number: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)  # items done so far, the open one last
    open: str | None = None  # "reasoning" | "message" | "function_call"
    calls: dict[int, int] = field(default_factory=dict)  # the parser's call index -> output index

    def emit(self, kind: str, **data: Any) -> str:
        payload = json.dumps({"type": kind, **data, "sequence_number": self.sequence_number},
                             ensure_ascii=False, separators=(",", ":"))
        self.sequence_number += 1
        return f"event: {kind}\ndata: {payload}\n\n"

    def text(self, text: str, kind: str) -> list[str]:
        """Text of a reasoning or message item, opened when it is not the open one."""
        if not text or (self.open != kind and not text.strip()):  # no item of whitespace between calls
            return []
        out = [] if self.open == kind else self._start(reasoning_item("") if kind == "reasoning" else message_item(""))
        item = self.output[-1]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return out + [self.emit("response.reasoning_text.delta", **where, delta=text)]
        return out + [self.emit("response.output_text.delta", **where, delta=text, logprobs=[])]

    def tool_call(self, entry: dict[str, Any]) -> list[str]:
        """One of the parser's OpenAI delta.tool_calls entries: a call's id and name first, then its arguments."""
        out = []
        if "id" in entry:
            out = self._start(function_call_item(entry["id"], entry["function"]["name"], ""))
            self.calls[entry["index"]] = len(self.output) - 1
        arguments = entry["function"].get("arguments")
        if arguments:
            index = self.calls[entry["index"]]
            item = self.output[index]
            item["arguments"] += arguments
            out.append(self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=arguments))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        index = len(self.output) - 1
        item = self.output[index]
        item["status"] = "completed"
        out = []
        if kind == "function_call":
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if kind == "reasoning":
                out.append(self.emit("response.reasoning_text.done", **where, text=part["text"]))
            else:
                out.append(self.emit("response.output_text.done", **where, text=part["text"], logprobs=[]))
                out.append(self.emit("response.content_part.done", **where, part=part))
        return out + [self.emit("response.output_item.done", output_index=index, item=item)]

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = item["type"]
        index = len(self.output) - 1
        added = {**item, "content": []} if "content" in item else item  # its text comes in deltas
        out.append(self.emit("response.output_item.added", output_index=index, item=added))
        if item["type"] == "message":
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part={**item["content"][0], "text": ""}))
        return out


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _chat_request(body: ResponsesRequest, history: tuple[dict[str, Any], ...]) -> ChatCompletionRequest:
    try:
        return chat_request(body, history)
    except ValidationError as exc:  # a rule of the chat path's messages (a call's arguments, ...)
        first = exc.errors(include_url=False)[0]
        raise APIError(400, f"input: {first['msg']}", "input") from None
