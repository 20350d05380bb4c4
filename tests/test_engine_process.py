"""EngineProcessClient: the engine core in a process of its own, driven directly (no HTTP). Its
tokens are the in-process client's and HF's, stop strings and aborts cross the boundary, bad input
never leaves this process, a killed core fails every open request and says why, and shutting down
leaves no process behind."""
from __future__ import annotations

import os
import re
import signal
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

import json
import threading

import httpx

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import EMBEDDING_SAMPLING, LLMEngine
from roseinfer.engine_client.client import SHUTDOWN_MESSAGE, ShuttingDownError
from roseinfer.engine_client.in_process import InProcessClient
from roseinfer.engine_client.process_client import EngineProcessClient
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.llm import LLM
from roseinfer.output_processor import StreamDelta
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.app import build_app
from server_helpers import serve_app, wait_for
from tiny_models import hf_greedy, sample_prompts

PROMPT = "The cat sees a red apple"


def child_pids(pid: int | str = "self") -> set[int]:
    """A process's live children (every thread's)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def client(model_dir: Path):
    c = EngineProcessClient(EngineConfig(model=str(model_dir), num_kv_blocks=128))
    c.start()
    yield c
    c.shutdown()


def drain(stream: RequestStream) -> list[StreamDelta]:
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(stream.get(timeout=60))
    return deltas


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


def test_tokens_and_text_equal_hf_and_the_in_process_client(client: EngineProcessClient, model_dir: Path) -> None:
    prompts = sample_prompts(model_dir, 6, seed=3, max_len=40)
    streams = [client.submit(ids, greedy(16)) for ids in prompts]
    results = [drain(s) for s in streams]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128))
    local = InProcessClient(engine)
    local.start()
    try:
        for ids, deltas in zip(prompts, results):
            tokens = [t for d in deltas for t in d.token_ids]
            assert tokens == hf_greedy(model_dir, ids, 16)
            assert deltas[-1].finish_reason == "length" and deltas[-1].error is None
            reference = drain(local.submit(ids, greedy(16)))
            assert "".join(d.text for d in deltas) == "".join(d.text for d in reference)
            assert [len(d.token_ids) for d in deltas] == [len(d.token_ids) for d in reference]
    finally:
        local.shutdown()
    assert wait_for(lambda: client.stats()["kv_used_blocks"] == 0 and client.stats()["num_inflight"] == 0)


def test_an_embedding_crosses_the_boundary_as_the_in_process_vector(client: EngineProcessClient,
                                                                    model_dir: Path) -> None:
    ids = client.engine.tokenizer.encode(PROMPT)
    pooling = client.engine.pooling_defaults
    final = drain(client.submit(ids, EMBEDDING_SAMPLING, pooling_params=pooling))[-1]
    local = LLM(model=str(model_dir), num_kv_blocks=128)
    try:
        reference = local.embed([ids], pooling, use_tqdm=False)[0].outputs.embedding
    finally:
        local.shutdown()
    assert final.embedding == reference and final.token_ids == []
    assert wait_for(lambda: client.stats()["kv_used_blocks"] == 0)


def test_constraints_compile_in_the_core_and_hold_beside_unconstrained_requests(client: EngineProcessClient,
                                                                               model_dir: Path) -> None:
    ids = client.engine.tokenizer.encode(PROMPT)
    patterns = [f"(yes|no)-[0-9]{{{n}}}" for n in (1, 2, 3)]
    free = client.submit(ids, greedy(24))
    constrained = [client.submit(ids, greedy(12, structured_outputs={"regex": p}, ignore_eos=False)) for p in patterns]
    aborted = client.submit(ids, greedy(12, structured_outputs={"regex": "[a-z]{5}"}))
    client.abort(aborted.request_id)  # while its constraint compiles, or just after: it ends either way
    texts = ["".join(d.text for d in drain(s)) for s in constrained]
    assert [t for d in drain(free) for t in d.token_ids] == hf_greedy(model_dir, ids, 24)
    assert drain(aborted)[-1].finish_reason == "abort"
    local = LLM(model=str(model_dir), num_kv_blocks=128)
    try:
        expected = [o.text for o in local.generate([ids] * 3, [greedy(12, structured_outputs={"regex": p},
                                                                       ignore_eos=False) for p in patterns],
                                                   use_tqdm=False)]
    finally:
        local.shutdown()
    assert texts == expected
    assert all(re.fullmatch(p, t) for p, t in zip(patterns, texts)), texts
    assert wait_for(lambda: client.stats()["kv_used_blocks"] == 0 and client.stats()["num_inflight"] == 0)


def test_a_stop_string_ends_the_request_in_the_core(client: EngineProcessClient) -> None:
    ids = client.engine.tokenizer.encode(PROMPT)
    full = "".join(d.text for d in drain(client.submit(ids, greedy(60))))
    stop = full[len(full) // 3:len(full) // 3 + 6]
    deltas = drain(client.submit(ids, greedy(60, stop=[stop])))
    assert "".join(d.text for d in deltas) == full[:full.index(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert deltas[-1].num_output_tokens < 60
    assert wait_for(lambda: client.stats()["kv_used_blocks"] == 0)  # the core freed its blocks


def test_abort_ends_the_stream_and_frees_the_blocks(client: EngineProcessClient) -> None:
    ids = client.engine.tokenizer.encode(PROMPT)
    stream = client.submit(ids, greedy(200))
    first = stream.get(timeout=60)
    assert not first.finished
    client.abort(stream.request_id)
    rest = drain(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].num_output_tokens < 200
    assert wait_for(lambda: client.stats()["kv_used_blocks"] == 0)


def test_bad_input_is_refused_before_anything_is_sent(client: EngineProcessClient) -> None:
    vocab = client.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt token ids"):
        client.submit([vocab + 5], greedy(4))
    with pytest.raises(ValueError, match="context length"):
        client.submit([1, 2, 3], greedy(client.engine.max_model_len))
    with pytest.raises(ValueError):
        client.submit([1, 2, 3], greedy(4, structured_outputs={"regex": "(unclosed"}))
    assert client.stats()["num_inflight"] == 0
    deltas = drain(client.submit([1, 2, 3], greedy(4)))  # the client still serves
    assert deltas[-1].finish_reason == "length"


def test_a_killed_core_fails_every_open_request_and_says_why(model_dir: Path) -> None:
    resource_tracker.ensure_running()
    before = child_pids()
    c = EngineProcessClient(EngineConfig(model=str(model_dir), num_kv_blocks=128))
    c.start()
    streams = [c.submit(c.engine.tokenizer.encode(f"{PROMPT} {i}"), greedy(200)) for i in range(4)]
    assert not streams[0].get(timeout=60).finished
    os.kill(c.process.pid, signal.SIGKILL)
    finals = [drain(s)[-1] for s in streams]
    assert all(f.finish_reason == "abort" and f.error_status == 500 and "SIGKILL" in f.error for f in finals)
    assert wait_for(lambda: not c.is_alive)
    assert "the engine process died (killed by SIGKILL)" == c.down_reason
    with pytest.raises(ShuttingDownError, match="SIGKILL"):
        c.submit([1, 2, 3], greedy(4))
    c.shutdown()
    assert child_pids() <= before


def test_shutdown_ends_what_runs_and_leaves_no_process(model_dir: Path) -> None:
    resource_tracker.ensure_running()  # multiprocessing's one helper process, started by the first spawn
    before = child_pids()
    c = EngineProcessClient(EngineConfig(model=str(model_dir), num_kv_blocks=128, tensor_parallel_size=2))
    c.start()
    assert child_pids() - before == {c.process.pid}
    ranks = child_pids(c.process.pid)
    assert len(ranks) == 1  # rank 1; rank 0 is the core itself
    ids = c.engine.tokenizer.encode(PROMPT)
    assert [t for d in drain(c.submit(ids, greedy(8))) for t in d.token_ids] == hf_greedy(model_dir, ids, 8)
    stream = c.submit(ids, greedy(200))
    assert not stream.get(timeout=60).finished
    c.shutdown()
    final = drain(stream)[-1]
    assert (final.error, final.error_status) == (SHUTDOWN_MESSAGE, 503)
    assert child_pids() <= before
    assert c.process.exitcode == 0
    assert wait_for(lambda: not any(alive(pid) for pid in ranks))


def test_the_server_fails_open_requests_and_says_why_when_the_core_is_killed(model_dir: Path) -> None:
    app = build_app(EngineConfig(model=str(model_dir), num_kv_blocks=128, engine_process="on"), "tiny")
    core = app.state.manager.process
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with serve_app(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        lines: list[str] = []
        answers: list[httpx.Response] = []

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        readers = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=body)))]
        for reader in readers:
            reader.start()
        assert wait_for(lambda: len(lines) > 1 and app.state.manager.stats()["num_running"] == 2)
        os.kill(core.pid, signal.SIGKILL)
        for reader in readers:
            reader.join(timeout=60)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 500 and "killed by SIGKILL" in error["message"]
        assert answers[0].status_code == 500 and "killed by SIGKILL" in answers[0].json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "the engine process died" in health.json()["error"]["message"]
        refused = c.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "killed by SIGKILL" in refused.json()["error"]["message"]
