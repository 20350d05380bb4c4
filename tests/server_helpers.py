"""Running the roseinfer app under a real uvicorn in a background thread, and reading /metrics."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Yields the base URL of `app` served on a free loopback port (lifespan included)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "server did not stop"


def model_copy(model_dir: Path, out: Path, max_position_embeddings: int | None = None,
               chat_template: str | None = None) -> Path:
    """A copy of a tiny checkpoint with a longer context (rotary models only: nothing learned is
    per position) or another chat template."""
    shutil.copytree(model_dir, out)
    if max_position_embeddings is not None:
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = max_position_embeddings
        (out / "config.json").write_text(json.dumps(config))
    if chat_template is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def openai_client(base_url: str, timeout: float = 120) -> openai.OpenAI:
    """The official client against a test server: no retries (a failure shows at once), no proxy."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=timeout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """One sample of GET /metrics (0.0 when the labelled series does not exist yet)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
