"""`roseinfer serve`: the FastAPI app (OpenAI + vLLM routes) and the uvicorn runner (flags: `server/args.py`)."""
from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import secrets
import signal
import socket
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine_client.client import EngineClient
from roseinfer.engine_client.in_process import InProcessClient
from roseinfer.engine_client.process_client import EngineProcessClient
from roseinfer.engine_client.select import make_engine_client
from roseinfer.loader.default_model import DEFAULT_MODEL_NAME
from roseinfer.server.args import ServerOptions, served_name, server_options
from roseinfer.server.body_limit import BodyLimit
from roseinfer.server.connections import GuardedH11Protocol
from roseinfer.server.embeddings import EMBEDDINGS_PATH, EmbeddingsRequest, EmbeddingsServing
from roseinfer.server.errors import add_error_handlers
from roseinfer.server.messages import AnthropicServing
from roseinfer.server.messages_protocol import (COUNT_TOKENS_PATH, MESSAGES_PATH, CountTokensRequest,
                                                MessagesErrorResponse, MessagesRequest)
from roseinfer.server.metrics import CountResponses, RouterMetrics, ServerMetrics
from roseinfer.server.openapi import (GENERATION_ERRORS, GENERATION_OK, MESSAGES_OK, TOKENIZER_ERRORS,
                                      error_responses, install_openapi, request_body)
from roseinfer.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)
from roseinfer.server.responses_protocol import RESPONSES_PATH, ResponsesRequest
from roseinfer.server.responses_routes import INPUT_ITEMS_PATH, STORED_PATH, add_responses_routes
from roseinfer.server.responses_store import ResponseStore
from roseinfer.server.serving import OpenAIServing
from roseinfer.server.structured import ConstraintLimits
from roseinfer.server.tool_calls import shown_tools

if TYPE_CHECKING:  # Ray is imported only when replicas are asked for
    from roseinfer.server.replicas import ReplicaSet

logger = logging.getLogger(__name__)
# uvicorn waits this much longer than --shutdown-timeout, so the error chunks that end cut streams go out
SHUTDOWN_MARGIN_S = 5.0
# Ray's switch between a cluster (its node address is the machine's) and one machine (loopback)
RAY_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "roseinfer"
    root: str  # the model as the user named it (a path, a hub id, or the default model)
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class MessageTokensCount(BaseModel):
    input_tokens: int


class DetokenizeResponse(BaseModel):
    prompt: str


def build_app(engine: LLMEngine | EngineConfig, served_model_name: str, options: ServerOptions | None = None) -> FastAPI:
    """The app owns an engine client, started and shut down by its lifespan: over `engine` in this
    process, or the one a configuration's engine_process asks for (the engine built now)."""
    options = options or ServerOptions()
    metrics = ServerMetrics()
    if isinstance(engine, EngineConfig):
        manager = make_engine_client(engine, options.stream_interval, options.max_inflight_requests,
                                     on_finished=metrics.observe_finished)
    else:
        manager = InProcessClient(engine, options.stream_interval, options.max_inflight_requests,
                                  on_finished=metrics.observe_finished)

    async def render_metrics() -> bytes:
        return metrics.render(manager.stats())

    return _app(manager, served_model_name, options, metrics, render_metrics)


def build_replicated_app(replicas: ReplicaSet, served_model_name: str, options: ServerOptions) -> FastAPI:
    """The same app in front of engine replicas (server/replicas.py), which stand in for the manager."""
    return _app(replicas, served_model_name, options, replicas.metrics, replicas.render_metrics)


def _app(manager: EngineClient | ReplicaSet, served_model_name: str, options: ServerOptions,
         metrics: ServerMetrics | RouterMetrics, render_metrics: Callable[[], Awaitable[bytes]]) -> FastAPI:
    engine = manager.engine
    started = int(time.time())  # /v1/models reports when this server started serving the model
    serving = OpenAIServing(manager, served_model_name, options.max_sequences_per_request, options.tool_call_parser,
                            ConstraintLimits(options.max_constraint_bytes, options.constraint_compile_timeout),
                            options.reasoning_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        manager.start()
        # what start-up built (tokenizer tables, the app, the engine in-process) lives as long as the
        # server: out of the collector's sight, a full collection under load stops the loop for less
        gc.freeze()
        try:
            yield
        finally:
            manager.shutdown()
            serving.close()

    # under --api-key the document is served behind the key, and the /docs and /redoc pages, which
    # fetch it from a browser that cannot send the key, are off
    keyless = not options.api_key
    app = FastAPI(title="roseinfer", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  openapi_url="/openapi.json" if keyless else None, docs_url="/docs" if keyless else None,
                  redoc_url="/redoc" if keyless else None)
    app.state.manager = manager
    app.state.metrics = metrics
    add_error_handlers(app, metrics)
    app.add_middleware(BodyLimit, max_bytes=options.max_request_body_bytes,
                       on_reject=lambda: metrics.rejected.labels("too_large").inc())
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    # added last: outermost, sees every response
    app.add_middleware(CountResponses, counter=metrics.responses, endpoint_counter=metrics.endpoint_responses,
                       endpoints=API_ENDPOINTS)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingsRequest,
                          MessagesRequest, CountTokensRequest, TokenizeRequest, DetokenizeRequest])
    guarded = _api_key_check(options.api_key)
    unauthorized = (401,) if options.api_key else ()

    if not keyless:
        @app.get("/openapi.json", dependencies=guarded, include_in_schema=False)
        async def openapi_document() -> JSONResponse:
            return JSONResponse(app.openapi())

    # bodies are parsed and validated off the event loop (server/request_body.py), not by FastAPI
    @app.post("/v1/completions", dependencies=guarded, responses={**GENERATION_OK, **error_responses(*GENERATION_ERRORS)},
              openapi_extra=request_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await serving.completions(await serving.parse(CompletionRequest, raw), raw)

    @app.post("/v1/chat/completions", dependencies=guarded,
              responses={**GENERATION_OK, **error_responses(*GENERATION_ERRORS)},
              openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(await serving.parse(ChatCompletionRequest, raw), raw)

    # in this process whatever runs the engine (a thread, a process, replicas): the event loop's alone
    add_responses_routes(app, serving, ResponseStore(options.responses_store_size, options.responses_store_bytes),
                         guarded)

    embeddings = EmbeddingsServing(serving)

    @app.post(EMBEDDINGS_PATH, dependencies=guarded, responses=error_responses(*GENERATION_ERRORS),
              openapi_extra=request_body(EmbeddingsRequest))
    async def create_embeddings(raw: Request) -> Response:
        """OpenAI's embeddings: each input's final hidden state, pooled (last token) and normalized."""
        return await embeddings.embeddings(await serving.parse(EmbeddingsRequest, raw), raw)

    anthropic = AnthropicServing(serving)

    @app.post(MESSAGES_PATH, dependencies=guarded,
              responses={**MESSAGES_OK, **error_responses(*GENERATION_ERRORS, model=MessagesErrorResponse)},
              openapi_extra=request_body(MessagesRequest))
    async def messages(raw: Request) -> Response:
        """Anthropic's Messages API; errors in Anthropic's shape."""
        return await anthropic.messages(await serving.parse(MessagesRequest, raw), raw)

    @app.post(COUNT_TOKENS_PATH, dependencies=guarded,
              responses=error_responses(400, 401, 404, 413, model=MessagesErrorResponse),
              openapi_extra=request_body(CountTokensRequest))
    async def count_tokens(raw: Request) -> MessageTokensCount:
        """Anthropic's: the prompt's length in tokens, as /v1/messages would template it."""
        return MessageTokensCount(**await anthropic.count_tokens(await serving.parse(CountTokensRequest, raw)))

    @app.get("/v1/models", dependencies=guarded, responses=error_responses(*unauthorized))
    async def models() -> ModelList:
        card = ModelCard(id=served_model_name, created=started, root=engine.config.model or DEFAULT_MODEL_NAME,
                         max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    @app.get("/health", response_class=Response, responses={200: {"description": "the engine worker runs (no body)"},
                                                            **error_responses(503)})
    async def health() -> Response:
        reason = manager.down_reason
        if reason is not None:
            raise APIError(503, reason)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}})
    async def prometheus() -> Response:
        return Response(await render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=guarded, responses=error_responses(*TOKENIZER_ERRORS),
              openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request) -> TokenizeResponse:
        body = await serving.parse(TokenizeRequest, raw)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = await serving.chat_prompt(body.messages, shown_tools(body.tools) if body.tools else None,
                                            body.chat_template_kwargs)
        else:
            ids = await serving.run_blocking(engine.tokenizer.encode, body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.get("/tokenizer_info", dependencies=guarded, responses=error_responses(*unauthorized))
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: the tokenizer's configuration (tokenizer_config.json as transformers reads it), so
        that a client (lm-evaluation-harness) can tokenize and template as the server does."""
        return engine.tokenizer.info()

    @app.post("/detokenize", dependencies=guarded, responses=error_responses(*TOKENIZER_ERRORS),
              openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> DetokenizeResponse:
        body = await serving.parse(DetokenizeRequest, raw)  # at most the context's length of ids
        serving.check_model(body.model)
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await serving.run_blocking(engine.tokenizer.decode, body.tokens))

    return app


def _api_key_check(api_key: str | None) -> list[Any]:
    """The dependency list of the guarded routes: none without a key."""
    if not api_key:
        return []
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key")
    # Anthropic's clients send the key in x-api-key; any guarded route takes either header
    x_api_key = APIKeyHeader(name="x-api-key", auto_error=False, description="the server's --api-key")

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
                    header_key: str | None = Depends(x_api_key)) -> None:
        given = (credentials.credentials if credentials is not None else header_key or "").encode()
        if not secrets.compare_digest(given, api_key.encode()):  # constant time: no timing oracle on the key
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # RFC 6750

    return [Depends(check)]


# the routes roseinfer_endpoint_responses_total counts apart (a path parameter's routes under their template)
API_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", RESPONSES_PATH, STORED_PATH, INPUT_ITEMS_PATH,
                           EMBEDDINGS_PATH, MESSAGES_PATH, COUNT_TOKENS_PATH, "/v1/models", "/tokenize", "/detokenize",
                           "/tokenizer_info"})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the engine drained first on the first SIGINT/SIGTERM: the manager
    takes no new requests and ends what still runs after --shutdown-timeout with an error event, so
    uvicorn, which waits SHUTDOWN_MARGIN_S longer, never has to cut a response off. A second signal
    cuts the drain short the same way, at once (uvicorn's own second Ctrl-C would cancel the
    handlers mid-response: torn streams, plain-text 500s, CancelledError tracebacks)."""

    def __init__(self, config: uvicorn.Config, manager: EngineClient | ReplicaSet, timeout: float) -> None:
        super().__init__(config)
        self.manager, self.timeout = manager, timeout
        self.cut_by: int | None = None  # the signal that cut the drain short

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.cut_by = sig
            self.manager.drain(0)
            return
        self.manager.drain(self.timeout)
        super().handle_exit(sig, frame)

    @property
    def exit_code(self) -> int:
        """0 after a clean stop, 128 + the signal's number (a shell's convention) after a drain cut
        short, 1 when the server never started."""
        if self.cut_by is not None:
            return 128 + self.cut_by
        return 0 if self.started else 1


def server_config(app: FastAPI, options: ServerOptions, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn as `roseinfer serve` runs it: h11 with the head's size and time limits
    (server/connections.py), the keep-alive timeout, and room for the drain."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=partial(GuardedH11Protocol, header_timeout=options.header_timeout),
                          h11_max_incomplete_event_size=options.max_header_bytes,
                          timeout_keep_alive=options.timeout_keep_alive,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=options.shutdown_timeout + SHUTDOWN_MARGIN_S)


def run_server(args: argparse.Namespace) -> int:
    from roseinfer.engine_args import engine_config_from_args

    options = server_options(args)
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = listening_socket(args.host, args.port)  # a port in use fails now, not after the model loads
    name = served_name(args)
    replicas = None
    if options.data_parallel_size > 1:
        replicas = start_replicas(engine_config_from_args(args), options, args.host)
        app = build_replicated_app(replicas, name, options)
        logger.info("%d engine replicas of %s on Ray (router: %s); serving it as %r on http://%s:%d",
                    options.data_parallel_size, replicas.engine.model_folder, options.router, name, args.host,
                    args.port)
    else:
        start = time.perf_counter()
        app = build_app(engine_config_from_args(args), name, options)
        engine = app.state.manager.engine
        logger.info("loaded %s in %.1fs (%d KV blocks, the engine %s); serving it as %r on http://%s:%d",
                    engine.model_folder, time.perf_counter() - start, engine.num_kv_blocks,
                    "in a process of its own" if isinstance(app.state.manager, EngineProcessClient) else
                    "in this process", name, args.host, args.port)
    server = DrainingServer(server_config(app, options, args.host, args.port, args.log_level), app.state.manager,
                            options.shutdown_timeout)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal into whatever
    # handler was there before; a do-nothing one lets the process exit with our own code.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if replicas is not None:
        replicas.close()
    return server.exit_code


def start_replicas(config: EngineConfig, options: ServerOptions, host: str) -> ReplicaSet:
    """Deploy the engine replicas on Ray; a clear error when Ray is not installed. A Ray this
    process starts listens only on loopback when the server does (docs/distributed.md)."""
    if options.ray_address is None and is_loopback(host):
        # Ray's servers (GCS, raylet, workers, agents, metrics exporter) listen on every interface
        # unless its node address is loopback, which Ray allows only in its single-machine mode. Ray
        # reads this as it is imported, and its processes take their address from this one.
        os.environ.setdefault(RAY_SINGLE_MACHINE_ENV, "0")
    try:
        from roseinfer.server.replicas import ReplicaSet
    except ImportError as exc:
        if exc.name is None or exc.name.split(".")[0] != "ray":
            raise
        raise ValueError(f"--data-parallel-size {options.data_parallel_size} runs the engine replicas on Ray, "
                         "which is not installed: pip install 'roseinfer[ray]'") from None
    return ReplicaSet(config, options.data_parallel_size, options.router, options.stream_interval,
                      options.max_inflight_requests, options.ray_address)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


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
