"""The app's error handlers: every error leaves in its API's shape (OpenAI's, Anthropic's on the
/v1/messages routes), validation errors as 400s naming the field, refusals counted by reason."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from roseinfer.server.messages_protocol import COUNT_TOKENS_PATH, MESSAGES_PATH
from roseinfer.server.messages_protocol import UNSUPPORTED_FIELDS as MESSAGES_UNSUPPORTED_FIELDS
from roseinfer.server.messages_protocol import error_body as messages_error_body
from roseinfer.server.metrics import RouterMetrics, ServerMetrics
from roseinfer.server.protocol import UNSUPPORTED_FIELDS, APIError, error_body
from roseinfer.server.responses_protocol import RESPONSES_PATH
from roseinfer.server.responses_protocol import UNSUPPORTED_FIELDS as RESPONSES_UNSUPPORTED_FIELDS
from roseinfer.server.responses_store import RESPONSE_NOT_FOUND

logger = logging.getLogger(__name__)

# the refused fields' reasons of the routes whose API is not chat's or completions'
UNSUPPORTED_BY_PATH = {MESSAGES_PATH: MESSAGES_UNSUPPORTED_FIELDS, COUNT_TOKENS_PATH: MESSAGES_UNSUPPORTED_FIELDS,
                       RESPONSES_PATH: RESPONSES_UNSUPPORTED_FIELDS}
ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
# why a request was refused, for roseinfer_requests_rejected_total (a stored response's id not found: its code)
REJECTION_REASONS = {400: "invalid", 401: "unauthorized", 404: "model_not_found", 413: "too_large",
                     429: "overloaded", 503: "unavailable"}


def add_error_handlers(app: FastAPI, metrics: ServerMetrics | RouterMetrics) -> None:
    """Every error leaves in OpenAI's shape (Anthropic's on /v1/messages); validation errors are
    400s (OpenAI's), not 422s."""

    def reply(request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None,
              rejected: bool = True) -> JSONResponse:
        if rejected and status in REJECTION_REASONS:
            code = body["error"]["code"]
            metrics.rejected.labels(code if code == RESPONSE_NOT_FOUND else REJECTION_REASONS[status]).inc()
        if request.url.path in ANTHROPIC_PATHS:  # Anthropic's clients read Anthropic's error shape
            body = messages_error_body(status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
        if errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", "")
            return reply(request, 400, error_body(400, f"malformed JSON body: {detail}"))
        fields = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
        param = fields[0][0] if fields[0] else None
        if errors[0].get("type") == "extra_forbidden":
            where = ".".join(fields[0])
            unsupported = UNSUPPORTED_BY_PATH.get(request.url.path, UNSUPPORTED_FIELDS)
            reason = unsupported.get(where, "roseinfer does not implement it")
            return reply(request, 400, error_body(400, f"unsupported field {where!r}: {reason}", param))
        # a union field (prompt) fails once per accepted shape: say so once, naming the field
        reasons = list(dict.fromkeys(e["msg"] for e, f in zip(errors, fields) if (f[0] if f else None) == param))
        return reply(request, 400, error_body(400, f"{param or 'body'}: {'; '.join(reasons[:4])}", param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return reply(request, exc.status_code, error_body(exc.status_code, str(exc.detail)),
                     getattr(exc, "headers", None), rejected=False)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return reply(request, 500, error_body(500, f"internal server error ({type(exc).__name__})"), rejected=False)
