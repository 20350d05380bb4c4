"""`roseinfer serve`'s own flags and the options they make. Kept apart from the app so that building
the CLI parser does not import FastAPI, uvicorn and pydantic: `generate`, `chat` and `bench` never
serve, and those imports held ~17 MiB resident in their processes."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from roseinfer.reasoning import REASONING_PARSERS
from roseinfer.server.router import ROUTER_POLICIES
from roseinfer.server.tool_parsers import PARSERS

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TOOL_CALL_PARSERS = ("auto", *PARSERS)
REASONING_PARSER_CHOICES = ("auto", "none", *REASONING_PARSERS)


@dataclass
class ServerOptions:
    stream_interval: int = 1  # flush a stream every N tokens
    max_inflight_requests: int | None = None  # 429 past this many sequences in flight
    max_sequences_per_request: int = 256  # prompts x n
    max_request_body_mb: float = 16.0  # larger bodies get a 413 before they are parsed
    api_key: str | None = None  # Bearer token required on /v1/*, /tokenize and /detokenize
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty = no CORS headers
    shutdown_timeout: float = 5.0  # seconds running requests get to finish on SIGINT/SIGTERM
    max_header_kb: int = 32  # a larger request line + headers gets a 431 (nginx's 4 x 8 KB)
    header_timeout: float = 30.0  # a connection gets this long to send a request's head, then 408 / close
    timeout_keep_alive: float = 5.0  # an idle connection between requests is closed after this long
    tool_call_parser: str = "auto"  # the format tool calls are read in; auto: from the chat template
    reasoning_parser: str = "auto"  # how <think> reasoning is split from the answer; auto: from the chat template
    data_parallel_size: int = 1  # engine replicas; more than one runs them on Ray (docs/distributed.md)
    ray_address: str | None = None  # join this Ray cluster; None starts a local Ray instance
    router: str = "prefix-affinity"  # which replica gets a request (server/router.py)
    # an output constraint's grammar text: OpenAI caps a schema's strings near 120,000 characters
    max_constraint_bytes: int = 128 * 1024
    constraint_compile_timeout: float = 10.0  # seconds; longer is a 400
    responses_store_size: int = 1000  # /v1/responses kept for previous_response_id and GET; 0: none
    responses_store_mb: float = 128.0  # and at most this much of their JSON text

    def __post_init__(self) -> None:
        for name in ("stream_interval", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 1:
            raise ValueError("--max-inflight-requests must be >= 1")
        if not self.max_request_body_mb > 0 or self.shutdown_timeout < 0:
            raise ValueError("--max-request-body-mb must be > 0 and --shutdown-timeout >= 0")
        if self.max_header_kb < 1 or not (self.header_timeout > 0 and self.timeout_keep_alive > 0):
            raise ValueError("--max-header-kb must be >= 1, --header-timeout and --timeout-keep-alive > 0")
        if self.max_constraint_bytes < 1 or not self.constraint_compile_timeout > 0:
            raise ValueError("--max-constraint-bytes must be >= 1 and --constraint-compile-timeout > 0")
        if self.responses_store_size < 0 or not self.responses_store_mb > 0:
            raise ValueError("--responses-store-size must be >= 0 and --responses-store-mb > 0")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if self.router not in ROUTER_POLICIES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_POLICIES)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_CHOICES)}")

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 2**20)

    @property
    def responses_store_bytes(self) -> int:
        return int(self.responses_store_mb * 2**20)

    @property
    def max_header_bytes(self) -> int:
        return self.max_header_kb * 2**10


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    defaults = ServerOptions()
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--served-model-name", default=None,
                       help=f"model name clients send (default: the --model basename, or {DEFAULT_SERVED_NAME})")
    group.add_argument("--stream-interval", type=int, default=defaults.stream_interval,
                       help="flush a stream every N tokens; the first and last always go out at once (default: 1)")
    group.add_argument("--max-inflight-requests", type=int, default=None,
                       help="answer 429 past this many sequences in flight (default: no limit)")
    group.add_argument("--max-sequences-per-request", type=int, default=defaults.max_sequences_per_request,
                       help="most sequences (prompts x n) one request may ask for; more is a 400 (default: %(default)s)")
    group.add_argument("--max-request-body-mb", type=float, default=defaults.max_request_body_mb,
                       help="larger request bodies are answered 413 before they are read (default: %(default)s)")
    group.add_argument("--max-constraint-bytes", type=int, default=defaults.max_constraint_bytes,
                       help="largest output constraint (guided_*, response_format, structured_outputs, forced tool "
                            "calls) as llguidance grammar text; larger is a 400 before compiling (default: %(default)s)")
    group.add_argument("--constraint-compile-timeout", type=float, default=defaults.constraint_compile_timeout,
                       help="seconds an output constraint may take to compile; longer is a 400 (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("ROSEINFER_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: "
                            "$ROSEINFER_API_KEY, else none); /health and /metrics stay open")
    group.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                       help="origins browsers may call from (CORS), e.g. https://app.example or * "
                            "(default: none, no CORS headers)")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                       help="on SIGINT/SIGTERM, seconds running requests get to finish before their streams are "
                            "ended with an error; a second signal ends them at once, and the server then exits "
                            "128 + its number (default: %(default)s)")
    group.add_argument("--max-header-kb", type=int, default=defaults.max_header_kb,
                       help="a request line + headers larger than this is answered 431 and the connection closed, "
                            "before authentication (default: %(default)s)")
    group.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                       help="seconds a connection gets to send a request's line and headers; a partial one is "
                            "answered 408, an idle one closed (slow-header clients) (default: %(default)s)")
    group.add_argument("--timeout-keep-alive", type=float, default=defaults.timeout_keep_alive,
                       help="close a keep-alive connection idle this many seconds after a response "
                            "(default: %(default)s)")
    group.add_argument("--tool-call-parser", default=defaults.tool_call_parser, choices=TOOL_CALL_PARSERS,
                       help="the format tool calls are read in: hermes (<tool_call>{...}</tool_call>), llama3_json "
                            "({\"name\": ..., \"parameters\": ...}); auto picks it from the chat template, hermes "
                            "when the template shows no tools (default: auto)")
    group.add_argument("--reasoning-parser", default=defaults.reasoning_parser, choices=REASONING_PARSER_CHOICES,
                       help="split <think>...</think> reasoning from the answer into message.reasoning_content and "
                            "message.reasoning: qwen3 (the reply may open with <think>), deepseek_r1 (the reply "
                            "starts inside the reasoning); a prompt that ends with <think> or </think> decides where "
                            "the reply starts either way; auto picks qwen3 when the chat template writes </think>, "
                            "none keeps reasoning in content (default: auto)")
    group.add_argument("--responses-store-size", type=int, default=defaults.responses_store_size,
                       help="/v1/responses kept in this server's memory for previous_response_id and GET / DELETE "
                            "/v1/responses/{id} (unless store is false), least recently used evicted first; 0 keeps "
                            "none, and store: true and previous_response_id are then a 400 (default: %(default)s)")
    group.add_argument("--responses-store-mb", type=float, default=defaults.responses_store_mb,
                       help="the stored responses' JSON text (each with the conversation it continues) is kept under "
                            "this many MiB, least recently used evicted first (default: %(default)s)")
    group.add_argument("--data-parallel-size", type=int, default=defaults.data_parallel_size,
                       help="engine replicas, each a Ray Serve deployment behind this server's one HTTP endpoint "
                            "(needs the roseinfer[ray] extra when > 1; see docs/distributed.md) (default: 1)")
    group.add_argument("--ray-address", default=None,
                       help="with --data-parallel-size > 1, join this Ray cluster (e.g. auto, or HOST:6379 of "
                            "`ray start --head`) (default: start a local Ray instance)")
    group.add_argument("--router", default=defaults.router, choices=ROUTER_POLICIES,
                       help="which replica gets a request: the one that got its prompt prefix before, else the "
                            "less loaded of two (prefix-affinity); the less loaded of two (least-loaded); or in "
                            "turn (round-robin) (default: %(default)s)")
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: info)")


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(stream_interval=args.stream_interval, max_inflight_requests=args.max_inflight_requests,
                         max_sequences_per_request=args.max_sequences_per_request,
                         max_request_body_mb=args.max_request_body_mb, api_key=args.api_key or None,
                         allowed_origins=list(args.allowed_origins), shutdown_timeout=args.shutdown_timeout,
                         max_header_kb=args.max_header_kb, header_timeout=args.header_timeout,
                         timeout_keep_alive=args.timeout_keep_alive,
                         tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                         data_parallel_size=args.data_parallel_size,
                         ray_address=args.ray_address, router=args.router,
                         max_constraint_bytes=args.max_constraint_bytes,
                         constraint_compile_timeout=args.constraint_compile_timeout,
                         responses_store_size=args.responses_store_size, responses_store_mb=args.responses_store_mb)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model.rstrip("/")).name if args.model else DEFAULT_SERVED_NAME
