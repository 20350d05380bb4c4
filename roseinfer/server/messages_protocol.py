"""Anthropic's Messages API (/v1/messages): its request body (pydantic), its error shape, and the
translation of a request into the chat path's ChatCompletionRequest, so that tokenizing, the chat
template, tools and stop strings are the chat endpoint's own.

Strict as the OpenAI bodies are (protocol.py): an unknown field is refused with a 400 naming it,
and the block types roseinfer cannot read (images, documents, ...) too. cache_control is taken and
ignored: the prefix cache reuses every shared prefix without being told. A thinking model's
reasoning comes back as a thinking block (with an empty signature: there is nothing to verify).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, StrictInt, model_validator

from roseinfer.server.protocol import (MAX_TOOLS, ChatCompletionRequest, FunctionName, JsonObject, JsonSchema,
                                       StrictModel, Text, bounded)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# Anthropic's error types by HTTP status (its API reference, "Errors")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
# Anthropic request fields that are refused, and why (the 400's message says it)
UNSUPPORTED_FIELDS = {
    "thinking": "extended thinking controls are not supported",
    "container": "code-execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "service_tier": "there is one service tier",
    "output_config": "effort controls and structured outputs are not supported on /v1/messages",
    "speed": "there is one speed",
}
TEXT_BLOCK_TYPES = ("text",)
USER_BLOCK_TYPES = ("text", "tool_result")
ASSISTANT_BLOCK_TYPES = ("text", "tool_use", "thinking")


class MessagesError(BaseModel):
    type: str
    message: str


class MessagesErrorResponse(BaseModel):
    """Anthropic's error body: every error /v1/messages sends has this shape."""

    type: Literal["error"]
    error: MessagesError


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: None = None  # citations come only from documents, which are refused


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Text
    name: FunctionName
    input: JsonObject
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    """An earlier turn's reasoning, as a client sends a reply back: left out of the prompt, as
    Anthropic's API leaves earlier turns' thinking out of the context."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text = ""


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


def _known_blocks(blocks: Any, allowed: tuple[str, ...], where: str) -> None:
    """A named refusal for a block type roseinfer cannot read, before pydantic's generic union error."""
    for block in blocks if isinstance(blocks, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise ValueError(f"{where}: content blocks of type {kind!r} are not supported here "
                             f"(only {', '.join(allowed)})")


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="before")
    @classmethod
    def _block_types(cls, data: Any) -> Any:
        if isinstance(data, dict):
            role = data.get("role")
            _known_blocks(data.get("content"), ASSISTANT_BLOCK_TYPES if role == "assistant" else USER_BLOCK_TYPES,
                          f"a {role} message")
        return data


class AnthropicTool(StrictModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are refused
    name: FunctionName
    description: Text | None = None
    input_schema: JsonSchema
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None  # with type "tool"
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice names a tool exactly when its type is "tool"')
        return self


class Metadata(StrictModel):
    user_id: Text | None = None  # recorded nowhere


class CountTokensRequest(StrictModel):
    """/v1/messages/count_tokens: the conversation a message would be generated for."""

    model: Text
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _system_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _known_blocks(data.get("system"), TEXT_BLOCK_TYPES, "system")
        return data


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    top_k: StrictInt | None = bounded("top_k")
    metadata: Metadata | None = None


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat endpoint's request for the same conversation: tool_use blocks become an assistant's
    tool_calls, tool_result blocks tool messages, and tool_choice any the chat path's "required"."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += _chat_messages(message)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    out: list[dict[str, Any]] = []  # a user turn: its tool results, then its text, in order
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block.text
        else:
            out.append({"role": "user", "content": block.text})
    return out
