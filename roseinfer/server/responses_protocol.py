"""OpenAI's Responses API (/v1/responses): its request body (pydantic) and its translation into the
chat path's ChatCompletionRequest, so that the chat template, tools, structured output and
reasoning are the chat endpoint's own (as messages_protocol.py does for Anthropic's API).

Strict as the other bodies are (protocol.py): an unknown field is a 400 naming it, with
UNSUPPORTED_FIELDS' reason for the ones OpenAI defines. A conversation goes back whole in `input`
(the output items of an earlier response are taken as input items as they come), or continues a
stored response (`previous_response_id`: its conversation's items come before `input`,
responses_store.py). An earlier turn's reasoning item is left out of the prompt, as thinking
templates drop earlier turns' reasoning.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Sequence, Union

from pydantic import Discriminator, Field, StrictInt, Tag, TypeAdapter

from roseinfer.server.protocol import (MAX_TOOLS, ChatCompletionRequest, FunctionName, JsonObject, JsonSchema,
                                       StrictModel, Text, bounded)

RESPONSES_PATH = "/v1/responses"
UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not stored: send the whole conversation in input",
    "background": "background responses are not supported",
    "include": "no extra output data (logprobs, encrypted reasoning, ...) is available",
    "reasoning": "no served model has reasoning controls",
    "top_logprobs": "logprobs are not available on /v1/responses (use /v1/chat/completions)",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "built-in tools are not supported",
    "service_tier": "there is one service tier",
    "stream_options": "stream obfuscation is not supported",
    "context_management": "context management is not supported",
}
Status = Literal["in_progress", "completed", "incomplete"]


class InputText(StrictModel):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictModel):
    """An earlier response's text, sent back as input."""

    type: Literal["output_text"]
    text: Text
    annotations: list[JsonObject] | None = None
    logprobs: list[JsonObject] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]
    id: Text | None = None
    status: Status | None = None
    phase: Text | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Text
    name: FunctionName
    arguments: Text  # JSON text, as OpenAI sends it
    id: Text | None = None
    status: Status | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]
    id: Text | None = None
    status: Status | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[JsonObject] = []
    content: list[JsonObject] | None = None
    encrypted_content: Text | None = None
    status: Status | None = None


def _item_kind(item: Any) -> str:
    # an item without a type is a message (OpenAI's EasyInputMessage)
    kind = item.get("type", "message") if isinstance(item, dict) else None
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind)]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None  # the schema is enforced whenever tool_choice constrains the output


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: FunctionName


class TextFormatPlain(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: FunctionName
    schema_: JsonSchema = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None  # the schema is always enforced


class TextConfig(StrictModel):
    format: Annotated[Union[TextFormatPlain, TextFormatJsonObject, TextFormatJsonSchema],
                      Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a model without controls has


class ResponsesRequest(StrictModel):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    stream: bool = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None  # unset: stored, as OpenAI's default, when the server keeps responses
    previous_response_id: Text | None = None
    truncation: Literal["disabled"] | None = None  # a prompt past the context is a 400, never cut
    # accepted: echoed back (metadata) or recorded nowhere, which changes nothing a client sees
    metadata: Annotated[dict[Text, Text], Field(max_length=16)] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_input_items = TypeAdapter(list[InputItem])


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items, each with an id (OpenAI lists a stored response's input so)."""
    if isinstance(body.input, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    else:
        items = [item.model_dump(exclude_none=True) for item in body.input]
    return [{"id": f"{ITEM_ID_PREFIXES[item['type']]}_{uuid.uuid4().hex}", **item} for item in items]


def chat_request(body: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat endpoint's request for the same conversation, `history` (a stored conversation's
    items) before the input: instructions as the system message, function_call items as an
    assistant's tool_calls, function_call_output items as tool messages, text.format as
    response_format."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in [*_input_items.validate_python(list(history)), *items]:
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": item.text})
        else:  # the assistant's reasoning, text and calls make one turn
            turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if isinstance(item, MessageItem):
                if turn is not None and not turn["content"] and "tool_calls" not in turn:
                    turn["content"] = item.text  # the text after the turn's reasoning
                else:
                    messages.append({"role": "assistant", "content": item.text})
                continue
            if turn is None:
                messages.append(turn := {"role": "assistant", "content": ""})
            if isinstance(item, FunctionCallItem):
                turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}})
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                              "stream": body.stream, "temperature": body.temperature, "top_p": body.top_p,
                              "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    text_format = body.text.format if body.text is not None else None
    if isinstance(text_format, TextFormatJsonObject):
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(text_format, TextFormatJsonSchema):
        fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
