"""Stored responses of the Responses API through the official openai client, on a tiny model:
previous_response_id continues the stored conversation (its prompt is the chat endpoint's for the
whole conversation, which test_server.py checks against HF transformers), retrieve, delete,
input_items, streaming with store, the count bound's least-recently-used eviction and its 404,
store: false, and a server that stores nothing; the store's bounds alone (responses_store.py)."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from roseinfer.server.responses_store import ResponseStore, StoredResponse
from server_helpers import llama_for_tools, metric, openai_client, serve_app, served

MODEL = "tiny-llama"
MAX_TOKENS = 8
STORE_SIZE = 2
FIRST = "Tell me a story."
NEXT = "Go on."


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return llama_for_tools(tiny_model_factory, tmp_path_factory.mktemp("responses_store"))


@pytest.fixture(scope="module")
def base_url(model_dir) -> Iterator[str]:
    options = ServerOptions(responses_store_size=STORE_SIZE)
    with serve_app(build_app(served(EngineConfig(model=str(model_dir))), MODEL, options)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0, **kwargs)


def chat_reply(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def test_previous_response_id_continues_the_whole_stored_conversation(client: openai.OpenAI) -> None:
    """Each turn's prompt is the chat endpoint's for every turn before it, the first included after
    it is evicted: an entry keeps the conversation it continues."""
    first = create(client, input=FIRST)
    second = create(client, input=NEXT, previous_response_id=first.id)
    conversation = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": NEXT}]
    expected = chat_reply(client, conversation)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.previous_response_id == first.id and second.store and first.store
    stateless = create(client, input=[{"role": "user", "content": FIRST}, *first.output,
                                      {"role": "user", "content": NEXT}], store=False)
    assert stateless.output_text == second.output_text and stateless.usage.input_tokens == second.usage.input_tokens
    third = create(client, input=[{"role": "user", "content": "And then?"}], previous_response_id=second.id,
                   instructions="Be brief.")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # evicted by the third (two kept), its turn still in the third's
    expected = chat_reply(client, [{"role": "system", "content": "Be brief."}, *conversation,
                                   {"role": "assistant", "content": second.output_text},
                                   {"role": "user", "content": "And then?"}])
    assert third.output_text == expected.choices[0].message.content
    assert third.usage.input_tokens == expected.usage.prompt_tokens


def test_retrieve_input_items_and_delete(client: openai.OpenAI) -> None:
    response = create(client, input=[{"role": "developer", "content": "Be kind."}, {"role": "user", "content": FIRST}])
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [(i.role, i.content[0].text if isinstance(i.content, list) else i.content) for i in items.data] == \
        [("user", FIRST), ("developer", "Be kind.")]  # newest first, OpenAI's default order
    ascending = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert [i.id for i in ascending.data] == [items.data[1].id] and ascending.has_more
    after = client.responses.input_items.list(response.id, order="asc", after=ascending.data[0].id)
    assert [i.id for i in after.data] == [items.data[0].id] and not after.has_more
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError, match=response.id):
            call(response.id)


def test_the_least_recently_used_is_evicted_with_a_404_naming_it(client: openai.OpenAI, base_url: str) -> None:
    a, b = create(client, input="a"), create(client, input="b")
    client.responses.retrieve(a.id)  # now b is the least recently used
    c = create(client, input="c")
    for kept in (a, c):
        assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError, match=b.id):
        client.responses.retrieve(b.id)
    with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as http:
        rejected = metric(http, "roseinfer_requests_rejected_total", reason="response_not_found")
        counted = metric(http, "roseinfer_endpoint_responses_total", endpoint="/v1/responses/{response_id}",
                         status="4xx")
        reply = http.post("/v1/responses", json={"input": "d", "previous_response_id": b.id})
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["param"] == "previous_response_id" and b.id in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == "response_not_found"
        assert http.get(f"/v1/responses/{b.id}").status_code == 404
        assert metric(http, "roseinfer_requests_rejected_total", reason="response_not_found") == rejected + 2
        assert metric(http, "roseinfer_endpoint_responses_total", endpoint="/v1/responses/{response_id}",
                      status="4xx") == counted + 1


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = create(client, input=FIRST, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_streamed_response_is_stored_as_it_completed(client: openai.OpenAI) -> None:
    final = list(create(client, input=FIRST, stream=True))[-1].response  # response.incomplete: cut at MAX_TOKENS
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    whole = create(client, input=NEXT, previous_response_id=final.id)
    streamed = list(create(client, input=NEXT, previous_response_id=final.id, stream=True))[-1].response
    assert streamed.output_text == whole.output_text and streamed.usage.input_tokens == whole.usage.input_tokens
    assert client.responses.retrieve(streamed.id).output_text == whole.output_text


def test_a_server_that_stores_nothing_refuses_store_and_previous_response_id(model_dir) -> None:
    options = ServerOptions(responses_store_size=0)
    with serve_app(build_app(LLMEngine(EngineConfig(model=str(model_dir))), MODEL, options)) as url:
        client = openai_client(url)
        assert create(client, input="Hi").store is False
        for field, value in (("store", True), ("previous_response_id", "resp_1")):
            with pytest.raises(openai.BadRequestError) as refused:
                create(client, input="Hi", **{field: value})
            assert refused.value.body["param"] == field and "--responses-store-size 0" in refused.value.body["message"]


def entry(text: str, earlier: StoredResponse | None = None) -> StoredResponse:
    return StoredResponse.of({"id": text, "output": [{"type": "message", "text": text}]}, [], earlier)


def test_the_store_holds_its_count_and_byte_bounds_least_recently_used_first() -> None:
    one = entry("x" * 100)
    store = ResponseStore(max_responses=3, max_bytes=3 * one.size)
    for name in "abc":
        assert store.put(name, entry("x" * 100))
    store.get("a")
    assert store.put("d", entry("x" * 100)) and store.get("b") is None and len(store) == 3  # the count bound
    assert store.put("e", entry("x" * 200)) and [k for k in "acde" if store.get(k)] == ["d", "e"]  # the bytes
    assert store.size == sum(store.get(k).size for k in "de") <= store.max_bytes
    assert not store.put("f", entry("x" * 1000)) and store.get("f") is None  # alone past the bound: not kept
    follow_up = entry("y", store.get("e"))
    assert follow_up.size > store.get("e").size and follow_up.conversation[0] == store.get("e").conversation[0]
    assert store.delete("d") and not store.delete("d") and store.size == store.get("e").size
    assert not ResponseStore(0, 1 << 20).put("a", one)  # disabled
