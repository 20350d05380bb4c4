"""OpenAI-compatible request bodies (pydantic) and the error body shape.

Field names and types follow OpenAI's API; the extra sampling fields (top_k, min_p, ...) follow
vLLM. Unknown fields are ignored, as OpenAI's clients send some we have no use for. Range checks
live in SamplingParams, the one place that owns them; pydantic checks shapes and types.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None = the default."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # optional, as in vLLM; when given it must name the served model
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    stop_token_ids: TokenIds | None = None
    prompt_logprobs: StrictInt | None = None  # per prompt token: its logprob and this many alternatives

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: StrictInt | None = None  # alternatives per token, OpenAI allows up to 5; with echo, the prompt's too


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template expects: content parts joined into one string."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name for max_tokens; wins if both
    logprobs: bool = False
    top_logprobs: StrictInt | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: TokenIds


ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "service_unavailable"}


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
