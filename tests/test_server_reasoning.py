"""Reasoning apart from the answer on /v1/chat/completions, through the official openai client, on
a tiny model whose template opens `<think>` (the reply starts inside the reasoning). A logit_bias
on `</think>` makes the random model close its reasoning partway, and the split is checked exactly
against HF transformers' greedy output under the same bias, streamed and not; enable_thinking false
(chat_template_kwargs) gives the answer alone; an output constraint with reasoning to come
constrains the answer after it (a regex one is a 400);
`--reasoning-parser none` leaves the reasoning in content."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
import torch

from roseinfer.cli import build_parser
from roseinfer.config import EngineConfig
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions, server_options
from roseinfer.tokenizer import Tokenizer
from server_helpers import model_copy, openai_client, serve_app, served, split_stream
from thinking_model import OPEN_THINKING_TEMPLATE, build_thinking_model
from tiny_models import hf_greedy, load_hf_model

MODEL = "tiny-thinker"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 30
END_BIAS = 3.0  # enough for the tiny model to write </think> partway, not so much that it writes nothing else
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reasoning")
    return model_copy(build_thinking_model(root / "qwen3"), root / "open", chat_template=OPEN_THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    with serve_app(build_app(served(EngineConfig(model=str(model_dir))), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url)


@pytest.fixture(scope="module")
def biased_reply(model_dir: Path, tokenizer: Tokenizer) -> tuple[list[int], int]:
    """HF's greedy tokens under the bias on </think>, and where the first </think> is."""
    end_id = tokenizer.encode("</think>", add_special_tokens=False)[0]
    prompt = torch.tensor([tokenizer.apply_chat_template(MESSAGES)])
    out = load_hf_model(model_dir).generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=MAX_TOKENS, sequence_bias={(end_id,): END_BIAS},
                                            pad_token_id=0)
    tokens = out[0, prompt.shape[1]:].tolist()
    end = tokens.index(end_id)
    # the test means something only if there is reasoning before the tag and an answer after it
    assert 0 < end and any(t != end_id for t in tokens[end + 1:]), tokens
    return tokens, end


def expected_split(tokenizer: Tokenizer, tokens: list[int]) -> tuple[str, str]:
    reasoning, answer = tokenizer.decode(tokens).split("</think>", 1)
    return reasoning.strip(), answer.lstrip()


def biased(tokenizer: Tokenizer) -> dict[str, Any]:
    end_id = tokenizer.encode("</think>", add_special_tokens=False)[0]
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logit_bias": {str(end_id): END_BIAS}, "extra_body": {"ignore_eos": True}}


def test_the_flag_is_checked_and_reaches_the_server_options() -> None:
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert server_options(args).reasoning_parser == "deepseek_r1"
    assert server_options(build_parser().parse_args(["serve"])).reasoning_parser == "auto"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerOptions(reasoning_parser="gpt_oss")


def test_a_reply_splits_into_reasoning_and_answer_as_hf_wrote_it(client: openai.OpenAI, tokenizer: Tokenizer,
                                                                 biased_reply: tuple[list[int], int]) -> None:
    tokens, end = biased_reply
    reasoning, answer = expected_split(tokenizer, tokens)
    reply = client.chat.completions.create(**biased(tokenizer))
    message = reply.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (reasoning, reasoning, answer)
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.completion_tokens_details.reasoning_tokens == end


def test_a_stream_sends_the_reasoning_then_the_answer(client: openai.OpenAI, tokenizer: Tokenizer,
                                                      biased_reply: tuple[list[int], int]) -> None:
    tokens, end = biased_reply
    reasoning, answer, kinds, usage = split_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **biased(tokenizer)))
    assert (reasoning, answer) == expected_split(tokenizer, tokens)
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all the reasoning first
    assert usage.completion_tokens_details.reasoning_tokens == end


def test_enable_thinking_false_reaches_the_template_and_leaves_the_answer_alone(
        client: openai.OpenAI, base_url: str, model_dir: Path, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, enable_thinking=False)
    assert len(prompt) != len(tokenizer.apply_chat_template(MESSAGES))
    tokenized = httpx.post(f"{base_url}/tokenize", json={"messages": MESSAGES, **NO_THINKING}, trust_env=False)
    assert tokenized.json()["tokens"] == prompt
    tokens = hf_greedy(model_dir, prompt, MAX_TOKENS)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, **NO_THINKING})
    message = reply.choices[0].message
    assert reply.usage.prompt_tokens == len(prompt)
    assert (message.reasoning_content, message.content) == (None, tokenizer.decode(tokens))
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


SMALL = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"],
         "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_an_output_constraint_constrains_the_answer_after_the_reasoning(
        client: openai.OpenAI, tokenizer: Tokenizer, biased_reply: tuple[list[int], int], stream: bool) -> None:
    """The reasoning is free (the same as HF's unconstrained reply up to </think>), the answer valid."""
    tokens, _ = biased_reply
    kwargs = {**biased(tokenizer), "max_tokens": 100,
              "response_format": {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}}}
    if stream:
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
            content += (delta.content or "") if delta else ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == expected_split(tokenizer, tokens)[0]
    jsonschema.validate(json.loads(content), SMALL)


def test_a_regex_constraint_is_refused_while_reasoning_is_to_come(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    assert refused.value.body["param"] == "structured_outputs"
    assert "after the reasoning" in refused.value.body["message"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           extra_body={"structured_outputs": {"regex": "[a-z]+"}, **NO_THINKING})
    assert reply.choices[0].message.content.isalpha()  # no reasoning: the regex constrains the answer


def test_chat_template_kwargs_may_not_set_what_the_server_sets(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set messages"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


def test_reasoning_parser_none_leaves_the_reasoning_in_content(model_dir: Path, tokenizer: Tokenizer,
                                                               biased_reply: tuple[list[int], int]) -> None:
    app = build_app(served(EngineConfig(model=str(model_dir))), MODEL, ServerOptions(reasoning_parser="none"))
    with serve_app(app) as url:
        reply = openai_client(url).chat.completions.create(**biased(tokenizer))
    message = reply.choices[0].message
    assert message.content == tokenizer.decode(biased_reply[0])
    assert "reasoning_content" not in message.model_extra and reply.usage.completion_tokens_details is None
