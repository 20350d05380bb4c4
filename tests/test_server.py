"""`roseinfer serve` end to end: a real uvicorn server on a loopback port, the official openai
client and raw HTTP, against the tiny random llama checkpoint."""
from __future__ import annotations

import asyncio
import json
import time
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from server_helpers import metric, model_copy, openai_client, serve_app, served, served_process, wait_for
from step_gate import StepGate

MODEL = "tiny-llama"
PROMPT = "The cat sees a red apple"
MESSAGES = [{"role": "user", "content": "Where do penguins live?"}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    """The offline API: the reference the server's greedy output must match."""
    return LLM(str(model_dir))


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    with serve_app(build_app(served(EngineConfig(model=str(model_dir))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url, timeout=60)


def reference(llm: LLM, prompt: str | list[int], max_tokens: int) -> tuple[str, int]:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.text, len(out.token_ids)


def chat_ids(llm: LLM) -> list[int]:
    return llm.apply_chat_template(MESSAGES)


# ---- completions and chat, streamed and not, against the offline API -------------------------
def test_completion_matches_offline_generate(client: openai.OpenAI, llm: LLM) -> None:
    text, n_tokens = reference(llm, PROMPT, 24)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.choices[0].text == text
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == n_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + n_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline_generate(client: openai.OpenAI, llm: LLM) -> None:
    text, n_tokens = reference(llm, chat_ids(llm), 20)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == text
    assert resp.usage.prompt_tokens == len(chat_ids(llm)) and resp.usage.completion_tokens == n_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client: openai.OpenAI, llm: LLM) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == llm.engine.max_model_len


def test_n_choices_with_a_seed_differ_and_reproduce(client: openai.OpenAI) -> None:
    def texts(n: int, seed: int) -> list[str]:
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=n, seed=seed)
        assert [c.index for c in resp.choices] == list(range(n))
        return [c.text for c in resp.choices]

    first = texts(3, seed=7)
    assert len(set(first)) == 3  # choice i samples with seed + i
    assert texts(3, seed=7) == first
    assert texts(1, seed=8) == first[1:2]


def test_prompt_shapes_give_one_choice_set_per_prompt(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    other = "Why is the sky blue?"
    resp = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=8, temperature=0, n=2)
    texts = [c.text for c in resp.choices]
    assert texts == [reference(llm, PROMPT, 8)[0]] * 2 + [reference(llm, other, 8)[0]] * 2
    assert resp.usage.prompt_tokens == len(ids) + len(llm.tokenizer.encode(other))
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == texts[:1] * 2
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert single.choices[0].text == llm.tokenizer.decode(ids) + texts[0]


def test_stop_strings_never_appear(client: openai.OpenAI, llm: LLM) -> None:
    full, _ = reference(llm, PROMPT, 48)
    stop = full[len(full) // 3:len(full) // 3 + 5]
    expected = full[:full.index(stop)]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=[stop, "zzz-unseen"])
    resp = client.completions.create(**kwargs)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens >= 1  # the tokens were generated, even if their text was cut
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_full, _ = reference(llm, chat_ids(llm), 48)
    chat_stop = chat_full[len(chat_full) // 2:len(chat_full) // 2 + 4]
    chat_kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0, stop=chat_stop)
    resp = client.chat.completions.create(**chat_kwargs)
    assert resp.choices[0].message.content == chat_full[:chat_full.index(chat_stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True,
                                                                                                 **chat_kwargs))
    assert streamed == resp.choices[0].message.content


def test_include_stop_str_in_output_keeps_the_stop(client: openai.OpenAI, llm: LLM) -> None:
    full, _ = reference(llm, PROMPT, 48)
    stop = full[len(full) // 3:len(full) // 3 + 5]
    expected = full[:full.index(stop) + len(stop)]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=stop,
                  extra_body={"include_stop_str_in_output": True})
    resp = client.completions.create(**kwargs)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == resp.usage.completion_tokens
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 2
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)
    streamed = [t for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]


def test_32_concurrent_streams_match_one_alone(base_url: str, client: openai.OpenAI) -> None:
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in prompts]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                     http_client=httpx.AsyncClient(trust_env=False, timeout=60))

        async def one(i: int) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=prompts[i % 8], max_tokens=16,
                                                      temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == [alone[i % 8] for i in range(32)]


# ---- lifecycle --------------------------------------------------------------------------------
def test_clients_that_disconnect_free_their_requests(model_dir: Path, tmp_path: Path) -> None:
    # requests of 60,000 tokens: none can finish before its client leaves, however fast the machine
    long_context = model_copy(model_dir, tmp_path / "long-context", max_position_embeddings=65536)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60_000, "ignore_eos": True, "stream": True}
    with serve_app(build_app(served(EngineConfig(model=str(long_context))), MODEL)) as base_url, \
            httpx.Client(base_url=base_url, trust_env=False, timeout=60) as http:
        for _ in range(4):
            with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                assert next(r.iter_lines()).startswith("data: ")  # a chunk, then hang up
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False, "n": 16},
                       timeout=httpx.Timeout(60, read=0.1), trust_env=False)
        assert wait_for(lambda: metric(http, "roseinfer_requests_total", finish_reason="abort") == 20, timeout=60)
        assert metric(http, "roseinfer_kv_cache_usage_ratio") == 0.0
        assert metric(http, "roseinfer_num_requests_running") == 0.0


def test_429_past_max_inflight_and_400_without_a_chat_template(model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "no-template"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=str(plain)))
    gate = StepGate(engine, monkeypatch)
    app = build_app(engine, MODEL, ServerOptions(max_inflight_requests=1))
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}

    async def burst(url: str) -> list[httpx.Response]:
        # eight at once: the first admitted holds the only slot, its steps held at the gate until
        # the other seven have their answers
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as ac:
            posts = [asyncio.ensure_future(ac.post("/v1/completions", json=body)) for _ in range(8)]
            first_seven = [await done for _, done in zip(range(7), asyncio.as_completed(posts))]
            assert [r.status_code for r in first_seven] == [429] * 7
            gate.allow()
            return await asyncio.gather(*posts)

    with serve_app(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        chat = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        responses = asyncio.run(burst(url))
        codes = [r.status_code for r in responses]
        assert sorted(codes) == [200] + [429] * 7, codes
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1" and set(refused.json()["error"]) == ERROR_KEYS
        assert wait_for(lambda: c.post("/v1/completions", json={"prompt": PROMPT}).status_code == 200)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": 12.5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1000}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"100000": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_is_answered_in_openai_error_shape(http: httpx.Client, path: str, body: dict, status: int,
                                                     param: str) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == ERROR_KEYS and error["param"] == param and error["message"]


def test_malformed_json_then_the_server_still_answers(http: httpx.Client, client: openai.OpenAI) -> None:
    resp = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "malformed JSON" in resp.json()["error"]["message"]
    assert http.post("/v1/completions", content=b"").status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-3)
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert metric(http, "roseinfer_num_requests_running") == 0.0


# ---- the other routes -------------------------------------------------------------------------
def test_tokenize_detokenize_models_metrics(http: httpx.Client, llm: LLM) -> None:
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tok == {"tokens": llm.tokenizer.encode(PROMPT), "count": len(tok["tokens"]),
                   "max_model_len": llm.engine.max_model_len}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == chat_ids(llm)
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert 0 < models[0]["created"] <= time.time()
    # the same prompt twice, so the counters below move (the second one hits the prefix cache)
    for _ in range(2):
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT * 3, "max_tokens": 3})
        assert done.status_code == 200
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "requests_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket"):
        assert f"roseinfer_{name}" in text
    assert metric(http, "roseinfer_generation_tokens_total") > 0
    assert metric(http, "roseinfer_prefix_cache_hits_total") > 0


def test_sigterm_past_the_shutdown_timeout_ends_every_request_with_an_error_and_exits_0(model_dir: Path,
                                                                                        tmp_path: Path) -> None:
    # requests of 60,000 tokens: none can finish before the signal, however slow or fast the machine
    long_context = model_copy(model_dir, tmp_path / "long-context", max_position_embeddings=65536)
    with served_process(long_context, "--shutdown-timeout", "0", timeout=60) as (proc, c):
        body = {"prompt": PROMPT, "max_tokens": 60_000, "ignore_eos": True}
        lines: list[str] = []
        answers: list[httpx.Response] = []

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        readers = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json={**body, "n": 4})))]
        for reader in readers:
            reader.start()
        assert wait_for(lambda: metric(c, "roseinfer_num_requests_running") == 5.0 and lines)
        proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=30)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "CancelledError" not in output, output
    # the stream ends with an error event and the end marker, not a torn body
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == 503
    assert answers[0].status_code == 503 and answers[0].json()["error"]["message"] == "the server is shutting down"


def test_sigterm_stops_roseinfer_serve_cleanly(model_dir: Path) -> None:
    with served_process(model_dir, "--log-level", "warning", timeout=30) as (proc, c):
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [model_dir.name]
        chunks: list[str] = []
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json=body) as r:
                chunks.extend(r.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_for(lambda: len(chunks) > 0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
        reader.join(timeout=10)
        assert chunks and chunks[-1] in ("data: [DONE]", "")  # the stream was ended, not torn
