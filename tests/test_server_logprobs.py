"""/v1/completions with echo + logprobs (OpenAI's legacy prompt scoring, as lm-evaluation-harness
sends it), echo with max_tokens 0, and vLLM's prompt_logprobs field, against the offline engine."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from server_helpers import metric, serve_app, wait_for

MODEL = "tiny-llama"
PROMPT = "The cat sees a red apple and the old teacher paints the quiet house"


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    """The offline engine, the reference for the server's logprobs."""
    return LLM(str(tiny_model_factory("llama")))


@pytest.fixture(scope="module")
def http(llm: LLM) -> Iterator[httpx.Client]:
    # a small token budget: the prompts below are prefilled in several chunks
    engine = LLMEngine(EngineConfig(model=str(llm.engine.model_folder), max_num_batched_tokens=8))
    with serve_app(build_app(engine, MODEL)) as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        yield c


def offline(llm: LLM, prompt: str | list[int], max_tokens: int, top: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top, prompt_logprobs=top)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def joined(chunks: list[dict[str, Any]]) -> dict[str, list]:
    """The chunks' legacy logprobs objects laid end to end."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]] for k in keys}


def assert_matches_engine(lp: dict[str, list], out, llm: LLM) -> None:
    """Prompt entries, then the completion's, equal to the engine's; offsets continue throughout."""
    entries = out.prompt_logprobs + out.logprobs
    ids = out.prompt_token_ids + out.token_ids
    assert lp["tokens"] == [llm.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-5)
    for top, entry in zip(lp["top_logprobs"][1:], entries[1:]):
        expected: dict[str, float] = {}
        for t, v in entry.top:  # alternatives that decode alike (partial UTF-8) keep the best value
            expected.setdefault(llm.tokenizer.decode([t], skip_special_tokens=False), v)
        assert top.keys() == expected.keys() and list(top.values()) == pytest.approx(list(expected.values()), abs=1e-5)
    assert lp["text_offset"][0] == 0
    assert all(b == a + len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))


def test_echo_with_logprobs_puts_the_prompt_first(http: httpx.Client, llm: LLM) -> None:
    out = offline(llm, PROMPT, 4, 2)
    assert len(out.prompt_token_ids) > 8  # more than one chunk on the server
    body = completion(http, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT + out.text and choice["finish_reason"] == "length"
    assert_matches_engine(choice["logprobs"], out, llm)
    assert body["usage"]["completion_tokens"] == 4
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for by name

    chunks = streamed(http, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert len(first["logprobs"]["tokens"]) >= len(out.prompt_token_ids)  # the prompt's come in the first chunk
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert joined(chunks) == choice["logprobs"]


def test_echo_with_max_tokens_0_returns_only_the_prompt(http: httpx.Client, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    out = offline(llm, ids, 1, 3)
    body = completion(http, prompt=ids, max_tokens=0, echo=True, logprobs=3)
    choice = body["choices"][0]
    assert choice["text"] == llm.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    out.token_ids, out.logprobs = [], []
    assert_matches_engine(choice["logprobs"], out, llm)
    chunks = streamed(http, prompt=ids, max_tokens=0, echo=True, logprobs=3)
    assert [c["choices"][0]["text"] for c in chunks] == [choice["text"]]
    assert chunks[0]["choices"][0]["finish_reason"] == "length" and joined(chunks) == choice["logprobs"]
    assert completion(http, prompt=ids, max_tokens=0, echo=True)["choices"][0]["logprobs"] is None


def test_lm_eval_loglikelihood_request(http: httpx.Client, llm: LLM) -> None:
    """What lm-eval's local-completions sends for a loglikelihood: token ids, echo, logprobs=1,
    max_tokens=1; it sums token_logprobs[ctxlen:-1] and checks each against the top one."""
    context, continuation = llm.tokenizer.encode("The cat sees"), llm.tokenizer.encode(" a red apple")
    prompts = [context + continuation, continuation + context]
    body = completion(http, prompt=prompts, max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt in zip(body["choices"], prompts):
        out = offline(llm, prompt, 1, 1)
        lp = choice["logprobs"]
        ctxlen = len(prompt) - len(continuation)
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
            sum(e.logprob for e in out.prompt_logprobs[ctxlen:]), abs=1e-4)
        greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(e.rank == 1 for e in out.prompt_logprobs[ctxlen:])


def test_prompt_logprobs_field_in_vllm_shape(http: httpx.Client, llm: LLM) -> None:
    out = offline(llm, PROMPT, 2, 2)
    choice = completion(http, prompt=PROMPT, max_tokens=2, prompt_logprobs=2)["choices"][0]
    assert choice["text"] == out.text and choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(out.prompt_token_ids) and entries[0] is None
    for entry, expected in zip(entries[1:], out.prompt_logprobs[1:]):
        actual = entry[str(expected.token_id)]
        assert actual["rank"] == expected.rank and actual["logprob"] == pytest.approx(expected.logprob, abs=1e-5)
        for rank, (token_id, value) in enumerate(expected.top, 1):
            assert entry[str(token_id)] == {"logprob": pytest.approx(value, abs=1e-5), "rank": rank,
                                            "decoded_token": llm.tokenizer.decode([token_id], skip_special_tokens=False)}
        assert len(entry) in (2, 3)
    messages = [{"role": "user", "content": "Where do penguins live?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == len(llm.apply_chat_template(messages)) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # just the prompt's own token
    assert wait_for(lambda: metric(http, "roseinfer_kv_cache_usage_ratio") == 0.0)


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": -1}, "logprobs"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),  # max_tokens 0 only with echo
])
def test_bad_values_are_a_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    resp = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
