"""The OpenAPI document as the server behaves: each route lists the error statuses it really sends,
all with OpenAI's error schema, and FastAPI's 422, which this server never sends (validation
errors are OpenAI's 400s), is taken out. Routes that parse their own body (server/request_body.py)
state it through `request_body`, so the document still describes it."""
from __future__ import annotations

from typing import Any, Sequence

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from roseinfer.server.protocol import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "the request is invalid: a field's value, an unsupported field, or a prompt the model cannot take",
    401: "no valid 'Authorization: Bearer' or 'x-api-key' API key (only when the server has --api-key)",
    404: "the model named is not the one this server serves, or a response id that is not stored (never stored, "
         "evicted or deleted)",
    413: "the request body is larger than --max-request-body-mb",
    429: "more requests in flight than --max-inflight-requests; retry after Retry-After seconds",
    500: "the engine failed the request (a bug), or the engine process died",
    503: "the server is shutting down, or its engine is not running (the message says why)",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413)


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": model, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


# 200 of the generation routes: JSON, or server-sent events with stream: true
GENERATION_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion as JSON, or as server-sent events ending with 'data: [DONE]' when "
                         "stream is true", "content": {"application/json": {}, "text/event-stream": {}}},
}

# 200 of /v1/messages: Anthropic's message as JSON, or its events with stream: true
MESSAGES_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "the message as JSON, or as server-sent events ending with 'event: message_stop' when "
                         "stream is true", "content": {"application/json": {}, "text/event-stream": {}}},
}

# 200 of /v1/responses: the Response object as JSON, or the Responses events with stream: true
RESPONSES_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "the response as JSON, or as server-sent events ending with 'event: response.completed' "
                         "(or response.incomplete) when stream is true",
          "content": {"application/json": {}, "text/event-stream": {}}},
}

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra stating its JSON body (install_openapi adds the model's schema)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, body_models: Sequence[type[BaseModel]] = ()) -> None:
    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, bodies = models_json_schema([(model, "validation") for model in body_models], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(bodies.get("$defs", {}))
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
