"""OpenAI-compatible request bodies (pydantic), the error body shape, and the limits both publish.

Field names and types follow OpenAI's API; the extra sampling fields (top_k, min_p, ...) and the
structured-output fields (structured_outputs, guided_*) follow vLLM. A field roseinfer does not
implement is refused (400 naming it, with UNSUPPORTED_FIELDS' reason), never silently dropped;
docs/server.md has the table of every OpenAI field and what happens to it.
Numeric ranges come from SamplingParams' BOUNDS, so the OpenAPI document states the ranges that
are enforced; non-finite floats and strings that are not valid Unicode (unpaired surrogates, also
as keys or values anywhere inside free-form JSON such as a tool's parameters) are refused here,
before anything reads them. Rules that span fields (a tool message's tool_call_id, /tokenize's one
of prompt or messages) are stated in the OpenAPI document too, so that it accepts what the server does.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints,
                      model_validator)

from roseinfer.sampling_params import BOUNDS
from roseinfer.server.json_values import integral, takes_int, valid_unicode, valid_unicode_json

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM's default max_logprobs is 20 too
MAX_N = 128  # OpenAI's limit on choices per request
MAX_TOOLS = 128  # OpenAI's limit on tools per request
SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})

# OpenAI request fields that are refused, and why (the 400's message says it); undeclared, so that
# the OpenAPI document does not offer them
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported (text models only)",
    "functions": "deprecated by OpenAI and not supported: send tools instead",
    "function_call": "deprecated by OpenAI and not supported: send tool_choice instead",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "no served model has reasoning controls",
    "verbosity": "no served model has verbosity controls",
    "web_search_options": "web search is not supported",
    "suffix": "fill-in-the-middle (suffix) is not supported",
}


def bounded(name: str, **extra: Any) -> Any:
    """Field(None) with SamplingParams' range for `name`."""
    return Field(None, **BOUNDS[name].field_kwargs(), **extra)


Text = Annotated[StrictStr, AfterValidator(valid_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# ASCII digits only: str.isdigit() also takes "²", which int() then refuses
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^-?[0-9]{1,12}$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
# OpenAI's rule for function names; it also keeps them safe inside the tool-call markup we parse
FunctionName = Annotated[StrictStr, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
JsonObject = Annotated[dict[str, Any], AfterValidator(valid_unicode_json)]  # free-form JSON, keys included
JsonSchema = JsonObject


def _not_server_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(set(kwargs) & SERVER_TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it from the request")
    return kwargs


# vLLM's chat_template_kwargs: extra variables for the chat template (e.g. enable_thinking)
TemplateKwargs = Annotated[JsonObject, AfterValidator(_not_server_variables)]


class StrictModel(BaseModel):
    # strict: a JSON value is taken only as the type the schema states (no false for a number,
    # no 1 or "true" for a boolean), so what the document says is what is accepted
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    _int_keys: ClassVar[frozenset[str]] = frozenset()  # the fields whose type holds an int

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._int_keys = frozenset(field.alias or name for name, field in cls.model_fields.items()
                                  if takes_int(field.annotation))

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        # here rather than a validator on each int type: pydantic then writes a constraint as "ge", not "minimum"
        if isinstance(data, dict) and not cls._int_keys.isdisjoint(data):
            return {key: integral(value) if key in cls._int_keys else value for key, value in data.items()}
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaSpec(StrictModel):
    name: FunctionName
    description: Text | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs request field: exactly one of these (see StructuredOutputsParams)."""

    json_: JsonSchema | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None  # Lark syntax, llguidance's dialect
    json_object: bool | None = None


class SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None = the default."""

    model: Text | None = None  # optional, as in vLLM; when given it must name the served model
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0 only with echo (the prompt alone)
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = bounded("seed")
    presence_penalty: float | None = bounded("presence_penalty")
    frequency_penalty: float | None = bounded("frequency_penalty")
    logit_bias: dict[TokenIdKey, Bias] | None = None
    user: Text | None = None  # an end-user id OpenAI's clients may send; recorded nowhere
    # vLLM's extensions
    top_k: StrictInt | None = bounded("top_k")
    min_p: float | None = bounded("min_p")
    repetition_penalty: float | None = bounded("repetition_penalty")
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(0, **BOUNDS["min_tokens"].field_kwargs())
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    # per prompt token: its logprob and this many alternatives
    prompt_logprobs: StrictInt | None = bounded("prompt_logprobs", le=MAX_LOGPROBS)
    # constraints on the output: OpenAI's response_format, vLLM's structured_outputs and the older
    # guided_* fields; at most one per request (server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


# an empty prompt is refused whatever the tokenizer (one that adds no BOS would leave nothing to prompt with)
PromptText = Annotated[StrictStr, StringConstraints(min_length=1), AfterValidator(valid_unicode)]


class CompletionRequest(SamplingRequest):
    # max_tokens 0 only with echo (serving.py's rule), stated in the OpenAPI document too
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
        "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}})

    prompt: Union[PromptText, Annotated[list[PromptText], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    echo: bool = False
    # alternatives per token; with echo, the prompt's too
    logprobs: StrictInt | None = bounded("logprobs", le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)  # only = n: no server-side ranking


class ContentPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: Text | None = None
    parameters: JsonSchema | None = None  # none: the function takes no arguments
    strict: bool | None = None  # arguments are enforced with tool_choice required or named, strict or not


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ToolCallFunction(StrictModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: Text
    type: Literal["function"]
    function: ToolCallFunction


def _required_with(role: str, field: str) -> dict[str, Any]:
    """JSON Schema: a message with this role needs `field` as a non-empty string."""
    return {"if": {"properties": {"role": {"const": role}}},
            "then": {"required": [field], "properties": {field: {"type": "string", "minLength": 1}}}}


class ChatMessage(StrictModel):
    # _role_fields' rules, stated in the OpenAPI document too (the arguments' JSON excepted)
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _required_with("tool", "tool_call_id"), _required_with("function", "name"),
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"tool_calls": {"type": "null"}}}}]})

    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None  # which tool call a "tool" message answers
    tool_calls: list[ToolCall] | None = None  # the calls an assistant message made
    # The rest of an OpenAI response message, so that one dumped whole (message.model_dump()) can be
    # sent back: a refusal is that turn's text; citations and empty audio / function_call change nothing.
    refusal: Text | None = None
    annotations: list[JsonObject] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _role_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs its tool_call_id")
        if self.role == "function" and not self.name:
            raise ValueError("a message with role 'function' needs the function's name")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for call in self.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise ValueError(f"tool call {call.id!r}: function.arguments is not valid JSON") from None
            try:  # a "\ud800" escape inside the JSON text decodes to a lone surrogate
                valid_unicode_json(arguments)
            except ValueError as exc:
                raise ValueError(f"tool call {call.id!r}: function.arguments: {exc}") from None
        return self

    @property
    def text(self) -> str:
        """The content as one string (parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or self.refusal or ""

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template expects: content as one string, tool-call arguments as the
        dict that templates write out with tojson (OpenAI sends them as JSON text; vLLM converts too)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id"):
            if getattr(self, key):
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # OpenAI's newer name for max_tokens; wins if both
    max_completion_tokens: StrictInt | None = Field(None, **BOUNDS["max_tokens"].field_kwargs())
    logprobs: bool = False
    top_logprobs: StrictInt | None = bounded("logprobs", le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text", "audio"]] | None = None  # "audio" is refused
    chat_template_kwargs: TemplateKwargs | None = None
    # Accepted and ignored, because ignoring them changes nothing a client can see: nothing is
    # stored (store true is refused), there is one service tier, the prefix cache needs no key,
    # and no response echoes these.
    metadata: Annotated[dict[Annotated[Text, StringConstraints(max_length=64)],
                             Annotated[Text, StringConstraints(max_length=512)]], Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None


class TokenizeRequest(StrictModel):
    # exactly one of prompt and messages, stated in the OpenAPI document too
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None  # rendered as in chat
    chat_template_kwargs: TemplateKwargs | None = None  # as in chat
    add_special_tokens: bool = True


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[TokenId]


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every error the server sends has this shape."""

    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape; `code` defaults to the HTTP status, as vLLM does."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status if code is None else code}}


class APIError(Exception):
    """An error answered in OpenAI's shape with the given HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)
