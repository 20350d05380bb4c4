"""Connections, authentication and shutdown through a real server (issue 35, items 4, 5, 7 and 8):
the request head's size and time limits (raw sockets), idle keep-alive connections, the API key on
the OpenAPI document and its WWW-Authenticate header, the in-flight slot of a client that left, a
second signal during the drain (`roseinfer serve` in its own process), and Ray's ports under
--data-parallel-size."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from server_helpers import metric, model_copy, serve_app, served_process, wait_for

MODEL = "tiny-llama"
KEY = "sk-test-key"
PROMPT = "The cat sees a red apple"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))


def _serve(engine: LLMEngine, **options: object):
    opts = ServerOptions(**options)  # type: ignore[arg-type]
    return serve_app(build_app(engine, MODEL, opts), opts)


def _connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)  # a hang fails the test, not a timing


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# ---- item 4: the head's size ---------------------------------------------------------------------
def test_a_64_mb_header_is_refused_before_authentication_and_health_keeps_answering(engine: LLMEngine) -> None:
    with _serve(engine, api_key=KEY) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        sock = _connect(url)
        sent, refused = 0, False
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
            chunk = b"a" * 2**20
            for _ in range(64):
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server closed the connection while the header was still coming
            refused = True
        try:
            answer = _read_all(sock)
        except ConnectionResetError:  # the unread rest of the header reset the connection
            answer = b""
        sock.close()
        # the kernel buffers a few MB at most: the server stopped reading long before 64 MB
        assert refused and sent < 32 * 2**20, sent
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert http.get("/health").status_code == 200


def test_a_head_over_the_limit_is_a_431_naming_the_flag_and_one_under_it_is_served(engine: LLMEngine) -> None:
    with _serve(engine, max_header_kb=1) as url:
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: %s\r\n\r\n"
        with _connect(url) as sock:  # 2 KB in one write: h11 alone would take it, being complete
            sock.sendall(head % (b"a" * 2000))
            answer = _read_all(sock)
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 ") and b"connection: close" in status, answer
        assert "--max-header-kb" in json.loads(body)["error"]["message"]
        with _connect(url) as sock:
            sock.sendall((head % (b"a" * 900)).replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nconnection: close\r\n"))
            assert _read_all(sock).startswith(b"HTTP/1.1 200 ")


# ---- item 8: idle and slow connections -----------------------------------------------------------
def test_idle_slow_header_and_idle_keep_alive_connections_are_closed(engine: LLMEngine) -> None:
    with _serve(engine, header_timeout=1.0, timeout_keep_alive=1.0) as url:
        with _connect(url) as idle:  # never sends a byte: closed without a word
            assert _read_all(idle) == b""
        with _connect(url) as slow:  # half a head, then nothing (slowloris): a 408, then closed
            slow.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            answer = _read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"--header-timeout" in answer, answer
        with _connect(url) as kept:  # served, then idle past --timeout-keep-alive: closed
            kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _read_all(kept).startswith(b"HTTP/1.1 200 ")
        with _connect(url) as upload:  # the limit is on the head: a body may take longer
            body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
            upload.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            time.sleep(1.5)  # past --header-timeout, with the head complete
            upload.sendall(body)
            assert _read_all(upload).startswith(b"HTTP/1.1 200 ")


# ---- item 8: the API key on the document, WWW-Authenticate ---------------------------------------
def test_the_api_key_guards_the_openapi_document_and_401s_name_the_scheme(engine: LLMEngine) -> None:
    with _serve(engine, api_key=KEY) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        for path in ("/openapi.json", "/v1/models"):
            refused = http.get(path)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", refused.text
        document = http.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
        assert document.status_code == 200 and "/v1/completions" in document.json()["paths"]
        assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
    with _serve(engine) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        assert http.get("/openapi.json").status_code == 200 and http.get("/docs").status_code == 200


# ---- item 8: a client that left frees its slot at once -------------------------------------------
def test_a_client_reconnecting_right_after_a_disconnect_is_admitted(model_dir: Path) -> None:
    """The engine takes one step at a time, each let through by the test: while the client goes
    away the worker is held before its next step, so the slot must free at the disconnect itself."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    gate, real_step = threading.Event(), engine.step
    holding = [True]
    gate.set()

    def held_step():  # type: ignore[no-untyped-def]
        gate.wait()
        out = real_step()
        if holding[0]:
            gate.clear()
        return out

    engine.step = held_step  # type: ignore[method-assign]
    options = ServerOptions(max_inflight_requests=1)
    app = build_app(engine, MODEL, options)
    with serve_app(app, options) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        # echoed, its first step's chunk carries the prompt, however the first token decodes
        with http.stream("POST", "/v1/completions", json={**body, "stream": True, "echo": True}) as first:
            next(first.iter_lines())  # the worker now waits at the gate
        assert wait_for(lambda: app.state.manager.stats()["num_inflight"] == 0, timeout=60)
        answer: list[httpx.Response] = []
        again = threading.Thread(target=lambda: answer.append(http.post("/v1/completions",
                                                                         json={**body, "max_tokens": 2})))
        again.start()
        assert wait_for(lambda: app.state.manager.stats()["num_inflight"] == 1 or bool(answer), timeout=60)
        holding[0] = False
        gate.set()
        again.join(timeout=60)
        assert answer and answer[0].status_code == 200, answer and answer[0].text


# ---- item 5: a second signal during the drain ----------------------------------------------------
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_signal_ends_every_request_with_an_error_and_exits_128_plus_it(model_dir: Path, tmp_path: Path,
                                                                               second: signal.Signals) -> None:
    """Requests that cannot finish (200,000 tokens of a 1M-position copy of the model) and a drain
    of 600 s: only the second signal can end them."""
    long_model = model_copy(model_dir, tmp_path / "long", max_position_embeddings=1_000_000)
    with served_process(long_model, "--shutdown-timeout", "600", "--log-level", "warning", timeout=120) as (proc, c):
        body = {"prompt": PROMPT, "max_tokens": 200_000, "ignore_eos": True}
        streams: list[list[str]] = [[] for _ in range(3)]
        answers: list[httpx.Response] = []

        def stream(lines: list[str]) -> None:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        readers = [threading.Thread(target=stream, args=(lines,)) for lines in streams]
        readers.append(threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=body))))
        for reader in readers:
            reader.start()
        assert wait_for(lambda: all(streams) and metric(c, "roseinfer_num_requests_running") == 4, timeout=120)
        proc.send_signal(signal.SIGTERM)
        port = int(str(c.base_url).rsplit(":", 1)[1].strip("/"))
        assert wait_for(lambda: not _listening(port), timeout=60)  # the first signal is being handled
        proc.send_signal(second)
        for reader in readers:
            reader.join(timeout=60)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + second, output
    assert "Traceback" not in output and "CancelledError" not in output, output
    for lines in streams:
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 503, lines[-3:]
    assert answers[0].status_code == 503 and answers[0].json()["error"]["message"] == "the server is shutting down"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


# ---- item 7: Ray's ports under --data-parallel-size ------------------------------------------------
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from Linux's /proc")
def test_ray_listens_only_on_loopback_when_the_server_does(model_dir: Path) -> None:
    """All but one port per replica: Ray Serve binds each replica's inter-deployment gRPC server to
    [::] in its code (Ray's token authentication guards it; docs/distributed.md says so)."""
    pytest.importorskip("ray")
    with served_process(model_dir, "--data-parallel-size", "2", "--log-level", "warning", timeout=120) as (proc, c):
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        sockets = _listening_sockets(_descendants(proc.pid))
    names = {name for name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets  # Ray's own servers are among those seen
    exposed = [name for name, address, _ in sockets if not _loopback(address)]
    assert exposed == ["ray::ServeRepli"] * 2, sockets


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _listening_sockets(pids: set[int]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN state that `pids` hold."""
    owners: dict[str, str] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owners[link[8:-1]] = name
        except OSError:  # it exited, or an fd closed meanwhile
            continue
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((owners[fields[9]], socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or \
        address.startswith("::ffff:127.")
