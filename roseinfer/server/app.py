"""`roseinfer serve`: the FastAPI app (OpenAI + vLLM routes) and the uvicorn runner (flags: `server/args.py`)."""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.args import served_name
from roseinfer.server.engine_loop import SchedulerManager
from roseinfer.server.metrics import ServerMetrics
from roseinfer.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, error_body)
from roseinfer.server.serving import OpenAIServing

logger = logging.getLogger(__name__)
# In-flight streams get this long to finish after SIGINT/SIGTERM; then they are cancelled (and
# aborted in the engine) so shutdown never hangs on a long generation.
GRACEFUL_SHUTDOWN_S = 5


def build_app(engine: LLMEngine, served_model_name: str, stream_interval: int = 1,
              max_inflight_requests: int | None = None) -> FastAPI:
    """The app owns a SchedulerManager over `engine`, started and shut down by its lifespan."""
    metrics = ServerMetrics()
    started = int(time.time())  # /v1/models reports when this server started serving the model
    manager = SchedulerManager(engine, stream_interval, max_inflight_requests, on_finished=metrics.observe_finished)
    serving = OpenAIServing(manager, served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        manager.start()
        try:
            yield
        finally:
            manager.shutdown()

    app = FastAPI(title="roseinfer", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.manager = manager
    app.state.metrics = metrics
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": started, "owned_by": "roseinfer",
                "root": str(engine.model_folder), "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not manager.is_alive:
            raise APIError(503, "the engine worker is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(manager.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = serving.chat_prompt(body.messages)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; validation errors are 400s (OpenAI's), not 422s."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
        if errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", "")
            return JSONResponse(error_body(400, f"malformed JSON body: {detail}"), status_code=400)
        fields = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
        param = fields[0][0] if fields[0] else None
        # a union field (prompt) fails once per accepted shape: say so once, naming the field
        reasons = list(dict.fromkeys(e["msg"] for e, f in zip(errors, fields) if (f[0] if f else None) == param))
        return JSONResponse(error_body(400, f"{param or 'body'}: {'; '.join(reasons[:4])}", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal server error ({type(exc).__name__})"), status_code=500)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from roseinfer.engine_args import engine_config_from_args

    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if args.max_inflight_requests is not None and args.max_inflight_requests < 1:
        raise ValueError("--max-inflight-requests must be >= 1")
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = listening_socket(args.host, args.port)  # a port in use fails now, not after the model loads
    engine = LLMEngine(engine_config_from_args(args))
    name = served_name(args)
    logger.info("loaded %s in %.1fs (%d KV blocks); serving it as %r", engine.model_folder, engine.load_seconds,
                engine.num_kv_blocks, name)
    app = build_app(engine, name, args.stream_interval, args.max_inflight_requests)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal into whatever
    # handler was there before; a do-nothing one lets the process exit 0 after a clean stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    app.state.manager.shutdown()  # no-op after the lifespan did it; needed after a forced exit
    return 0 if server.started else 1


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything slow happens (vLLM binds first too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
