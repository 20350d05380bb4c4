"""Running the roseinfer app under a real uvicorn in a background thread, and reading /metrics."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
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

from roseinfer.config import EngineConfig
from roseinfer.server.app import server_config
from roseinfer.server.args import ServerOptions


# the server tests run with the engine core in a thread of the server (off, the default here) or in a
# process of its own (on): run them both ways, e.g. ROSEINFER_TEST_ENGINE_PROCESS=on pytest tests/test_server.py
ENGINE_PROCESS = os.environ.get("ROSEINFER_TEST_ENGINE_PROCESS", "off")


def served(config: EngineConfig) -> EngineConfig:
    """The configuration the server tests hand build_app, its engine where ENGINE_PROCESS says."""
    return dataclasses.replace(config, engine_process=ENGINE_PROCESS)


@contextmanager
def serve_app(app: FastAPI, options: ServerOptions | None = None) -> Iterator[str]:
    """Yields the base URL of `app` served on a free loopback port (lifespan included), under the
    uvicorn configuration `roseinfer serve` runs with `options` (its connection limits)."""
    server = uvicorn.Server(server_config(app, options or ServerOptions(), "127.0.0.1", 0, "warning"))
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


STARTUP_GUARD_S = 600  # Ray replicas on a busy machine can take minutes to start


@contextmanager
def served_process(model_dir: Path, *flags: str, timeout: float) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """`roseinfer serve` in its own process (output captured), once /health answers, with a client;
    killed on the way out if it is still running."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "roseinfer.cli", "serve", "--model", str(model_dir),
                             "--port", str(port), *flags], env={**os.environ, "NO_PROXY": "127.0.0.1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=timeout) as c:
            # a guard against a hang, not a bound on start-up: _up fails at once if the process dies
            assert wait_for(lambda: _up(c, proc), timeout=STARTUP_GUARD_S), f"no /health within {STARTUP_GUARD_S} s"
            yield proc, c
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _up(c: httpx.Client, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.stdout.read()
    try:
        return c.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def llama_for_tools(tiny_model_factory: Callable[[str], Path], folder: Path) -> Path:
    """The tiny Llama with 1024 positions: the tools' system prompt is longer than its 256."""
    return model_copy(tiny_model_factory("llama"), folder / "llama", max_position_embeddings=1024)


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


def split_stream(chunks) -> tuple[str, str, list[str], object]:
    """A streamed chat reply (the openai client's chunks): its reasoning, its answer, the kind of each
    piece in order ("reasoning" / "content"), and the final usage; each delta's `reasoning` must be
    its `reasoning_content`."""
    kinds, reasoning, answer, usage = [], "", "", None
    for chunk in chunks:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert delta.reasoning == delta.reasoning_content
            reasoning += delta.reasoning_content
            kinds.append("reasoning")
        if delta.content:
            answer += delta.content
            kinds.append("content")
    return reasoning, answer, kinds, usage
