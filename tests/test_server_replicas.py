"""--data-parallel-size: engine replicas on Ray Serve behind one ingress (server/replicas.py), and
the router's policies (server/router.py). One local Ray instance with two replicas of a tiny model
serves every Ray case in this module (Ray's start-up is most of the time)."""
from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.llm import LLM
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.args import ServerOptions
from roseinfer.server.router import ReplicaRouter, prefix_hashes
from server_helpers import metric, serve_app

MODEL = "tiny-llama"
# guards against a hang, not bounds on time: a killed replica's calls wait for its replacement to start,
# which on a busy machine can take minutes
HANG_GUARD_S = 600
BLOCK = 16


# ---- the router alone ------------------------------------------------------------------------
def test_prefix_hashes_are_chained_over_full_blocks_without_the_last_token() -> None:
    ids = list(range(100))
    hashes = prefix_hashes(ids, BLOCK)
    assert len(hashes) == 6  # 99 cacheable tokens: 6 full blocks
    assert prefix_hashes(ids[:33], BLOCK) == hashes[:2]  # 32 cacheable tokens: exactly two blocks
    other = prefix_hashes([7] + ids[1:], BLOCK)
    assert all(a != b for a, b in zip(hashes, other))  # a change in block 0 changes every later key
    assert prefix_hashes(ids, BLOCK, limit=3) == hashes[:3]


def test_prefix_affinity_follows_the_longest_known_prefix_unless_that_replica_is_overloaded() -> None:
    router = ReplicaRouter(4, "prefix-affinity", BLOCK, seed=0)
    shared = list(range(64))
    first = router.route(shared + [100, 101])
    assert not first.prefix_hit
    again = router.route(shared + [200])
    assert again.prefix_hit and again.replica == first.replica
    router.inflight[first.replica] = 100  # far busier than the others: balance wins over affinity
    moved = router.route(shared + [300])
    assert not moved.prefix_hit and moved.replica != first.replica
    assert router.route(shared + [400], exclude=(moved.replica,)).replica != moved.replica


def test_least_loaded_and_round_robin() -> None:
    router = ReplicaRouter(2, "least-loaded", BLOCK, seed=0)
    router.inflight[:] = [5, 1]
    assert {router.route([1, 2, 3]).replica for _ in range(10)} == {1}
    cycle = ReplicaRouter(3, "round-robin", BLOCK)
    assert [cycle.route([1]).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert cycle.route([1], exclude=(0,)).replica == 1
    with pytest.raises(ValueError, match="--router"):
        ReplicaRouter(2, "random", BLOCK)


def test_without_ray_the_flag_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from roseinfer.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    for name in ("roseinfer.server.replicas", "roseinfer.server.replica"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["serve", "--data-parallel-size", "2", "--port", "18601"]) == 2
    err = capsys.readouterr().err
    assert "roseinfer[ray]" in err and "Traceback" not in err


# ---- two replicas on a local Ray -------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def replicas(model_dir: Path) -> Iterator:
    pytest.importorskip("ray", reason="needs the roseinfer[ray] extra")
    from roseinfer.server.replicas import ReplicaSet

    replica_set = ReplicaSet(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64), 2)
    try:
        yield replica_set
    finally:
        replica_set.close()


@pytest.fixture(scope="module")
def http(replicas) -> Iterator[httpx.Client]:
    from roseinfer.server.app import build_replicated_app

    with serve_app(build_replicated_app(replicas, MODEL, ServerOptions(data_parallel_size=2))) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=HANG_GUARD_S) as client:
        yield client


def complete(http: httpx.Client, prompt: str | list[int], max_tokens: int = 8) -> dict:
    resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_concurrent_requests_are_spread_and_equal_one_engines_greedy_output(http: httpx.Client,
                                                                           model_dir: Path) -> None:
    prompts = [f"The {word} sees a red apple" for word in ("cat", "dog", "bird", "fox", "cow", "owl", "bee", "ant")]
    before = [metric(http, "roseinfer_requests_total", replica=str(i), finish_reason="length") for i in (0, 1)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda p: complete(http, p, 12), prompts))
    after = [metric(http, "roseinfer_requests_total", replica=str(i), finish_reason="length") for i in (0, 1)]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas served some
    offline = LLM(str(model_dir)).generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [r["choices"][0]["text"] for r in served] == [o.text for o in offline]
    assert [r["usage"]["completion_tokens"] for r in served] == [len(o.token_ids) for o in offline]

    streamed = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0,
                                                  "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    bad = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 10_000})
    assert bad.status_code == 400 and "context length" in bad.json()["error"]["message"]


def test_a_constraint_is_checked_at_the_ingress_and_enforced_by_the_replica(http: httpx.Client) -> None:
    choices = ["left turn", "right turn"]
    resp = http.post("/v1/completions", json={"prompt": "Go", "max_tokens": 8, "guided_choice": choices})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] in choices, resp.text
    bad = http.post("/v1/completions", json={"prompt": "Go", "guided_regex": "(("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"


def test_requests_sharing_a_prefix_go_to_the_replica_that_caches_it(http: httpx.Client) -> None:
    shared = [(7 * i) % 300 + 3 for i in range(80)]  # 5 blocks, unlike any other test's prompt
    hits = [metric(http, "roseinfer_prefix_cache_hits_total", replica=str(i)) for i in (0, 1)]
    affinity = [metric(http, "roseinfer_router_prefix_affinity_hits_total", replica=str(i)) for i in (0, 1)]
    for suffix in range(4):
        complete(http, shared + [suffix + 10, suffix + 20], 2)
    gained = [metric(http, "roseinfer_prefix_cache_hits_total", replica=str(i)) - hits[i] for i in (0, 1)]
    routed = [metric(http, "roseinfer_router_prefix_affinity_hits_total", replica=str(i)) - affinity[i]
              for i in (0, 1)]
    owner = 0 if routed[0] else 1
    assert routed[owner] == 3 and routed[1 - owner] == 0  # the first found nobody; the next three its replica
    assert gained[owner] == 3 * 80 and gained[1 - owner] == 0  # each later prompt reused the 5 shared blocks


def test_a_killed_replica_is_replaced_and_the_other_keeps_serving(http: httpx.Client, replicas) -> None:
    victim = replicas.handles[1].info.remote().result()["pid"]
    os.kill(victim, signal.SIGKILL)
    for word in ("one", "two", "three", "four"):  # none may fail: a call to the dead one is retried
        assert complete(http, f"After the crash, {word}", 4)["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            pid = replicas.handles[1].info.remote().result(timeout_s=5)["pid"]
            if pid != victim:
                break
        except Exception:  # noqa: BLE001 -- the replacement is still starting
            pass
        assert time.monotonic() < deadline, f"Serve did not replace the killed replica within {HANG_GUARD_S} s"
        time.sleep(0.5)
    assert metric(http, "roseinfer_router_replica_up", replica="1") == 1.0


def test_embeddings_are_served_by_the_replicas_as_by_one_engine(http: httpx.Client, model_dir: Path) -> None:
    texts = ["The cat sees a red apple", "Hello", "Paris is the capital of France."]
    resp = http.post("/v1/embeddings", json={"model": MODEL, "input": texts})
    assert resp.status_code == 200, resp.text
    offline = LLM(str(model_dir)).embed(texts, use_tqdm=False)
    for data, want in zip(resp.json()["data"], offline):
        # the bound of test_embeddings.py: the replicas' steps batch the inputs as LLM.embed's may not
        torch.testing.assert_close(torch.tensor(data["embedding"]), torch.tensor(want.outputs.embedding),
                                   atol=1e-5, rtol=0)
    assert resp.json()["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)


def test_a_stored_response_is_continued_whichever_replica_serves_the_follow_up(http: httpx.Client) -> None:
    """The store is the ingress's: every follow-up of one stored response, wherever it is routed,
    runs the whole conversation, as the chat endpoint's request for it does."""
    first = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, "temperature": 0}).json()
    follow_ups = [http.post("/v1/responses", json={"input": "Go on.", "previous_response_id": first["id"],
                                                   "max_output_tokens": 4, "temperature": 0}).json()
                  for _ in range(4)]
    text = first["output"][0]["content"][0]["text"]
    chat = http.post("/v1/chat/completions", json={"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": text},
        {"role": "user", "content": "Go on."}]}).json()
    for follow_up in follow_ups:
        assert follow_up["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
        assert follow_up["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert http.get(f"/v1/responses/{follow_ups[-1]['id']}").json() == follow_ups[-1]
