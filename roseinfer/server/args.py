"""`roseinfer serve`'s own flags. Kept apart from the app so that building the CLI parser does not
import FastAPI, uvicorn and pydantic: `generate`, `chat` and `bench` never serve, and those imports
held ~17 MiB resident in their processes."""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--served-model-name", default=None,
                       help=f"model name clients send (default: the --model basename, or {DEFAULT_SERVED_NAME})")
    group.add_argument("--stream-interval", type=int, default=1,
                       help="flush a stream every N tokens; the first and last always go out at once (default: 1)")
    group.add_argument("--max-inflight-requests", type=int, default=None,
                       help="answer 429 past this many requests in flight (default: no limit)")
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: info)")


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model.rstrip("/")).name if args.model else DEFAULT_SERVED_NAME
