"""gpt-oss's harmony channels (roseinfer/harmony.py): the split of a reply's token ids into reasoning,
answer and tool calls, whole and fed in every way; which templates and tokenizers get the parser;
calls handed to the tool parser whole and streamed; and end to end through the server with the
official openai client, on a tiny gpt-oss whose reply is made to spell harmony by an answer
constraint (the grammar after_reasoning puts after the analysis channel) and a bias on <|end|>."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from roseinfer import LLM
from roseinfer.config import EngineConfig
from roseinfer.harmony import HarmonyParser, HarmonyTokens
from roseinfer.output_processor import StreamDelta
from roseinfer.reasoning import after_reasoning, pick_reasoning_parser
from roseinfer.sampling_params import SamplingParams, StructuredOutputsParams
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from roseinfer.engine.structured_output import JSON_WHITESPACE
from roseinfer.server.reply_parts import split_delta, split_reply
from roseinfer.server.tool_parsers import ChannelCallParser
from roseinfer.server.tool_calls import pick_parser
from roseinfer.tokenizer import Tokenizer
from harmony_model import HARMONY_TEMPLATE, build_harmony_model
from server_helpers import openai_client, serve_app, served, split_stream
from tiny_models import CHAT_TEMPLATE

MODEL = "tiny-gpt-oss"
CALL = '{"city": "Paris"}'
# (reply, reasoning, content, calls)
CASES = [
    ("<|channel|>analysis<|message|>Think é.<|end|><|start|>assistant<|channel|>final<|message|>Blue.<|return|>",
     "Think é.", "Blue.", []),
    ("<|channel|>final<|message|>Just the answer.<|return|>", None, "Just the answer.", []),
    ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{CALL}<|call|>", "Look it up.", None,
     [("get_weather", CALL)]),
    # the recipient in the header before the channel, as gpt-oss also writes it
    (f"<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>"
     f"{CALL}<|call|>", "a", None, [("f", CALL)]),
    # a preamble to no one is shown as the answer is
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
     None, "Checking.Done.", []),
    ("<|channel|>analysis<|message|>cut off mid", "cut off mid", None, []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", "a", None, []),
    ("no harmony at all", None, "no harmony at all", []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_model(tmp_path_factory.mktemp("harmony") / "gpt_oss")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def harmony(tokenizer: Tokenizer) -> HarmonyTokens:
    tokens = pick_reasoning_parser(tokenizer.chat_template, "auto", tokenizer)
    assert isinstance(tokens, HarmonyTokens)
    return tokens


def fed(harmony: HarmonyTokens, tokenizer: Tokenizer, ids: list[int], cuts: list[int]) -> HarmonyParser:
    parser = harmony.parser([], tokenizer)
    for start, end in zip([0] + cuts, cuts + [len(ids)]):
        parser.feed("ignored", ids[start:end])
    parser.finish()
    return parser


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_reply_splits_alike_whole_and_in_every_feeding(harmony: HarmonyTokens, tokenizer: Tokenizer,
                                                          case: int) -> None:
    reply, reasoning, content, calls = CASES[case]
    ids = tokenizer.encode(reply, add_special_tokens=False)
    whole = harmony.parser([], tokenizer)
    assert whole.parse("", ids) == (reasoning, content) and whole.calls == calls
    rng = random.Random(case)
    feedings = [list(range(1, len(ids)))] + [sorted(rng.sample(range(1, len(ids)), k)) for k in (1, 3, 7)]
    for cuts in feedings:
        parser = fed(harmony, tokenizer, ids, cuts)
        assert (parser.reasoning or None, parser.content or None, parser.calls) == (reasoning, content, calls)


def test_reasoning_tokens_are_the_analysis_bodies_and_their_ends(harmony: HarmonyTokens,
                                                                 tokenizer: Tokenizer) -> None:
    body = tokenizer.encode("Think it over.", add_special_tokens=False)
    ids = tokenizer.encode("<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant<|channel|>final"
                           "<|message|>Yes.<|return|>", add_special_tokens=False)
    parser = harmony.parser([], tokenizer)
    parser.parse("", ids)
    assert parser.reasoning_tokens == len(body) + 1


def test_the_parsers_are_picked_from_the_template_and_the_flag(model_dir: Path, tokenizer: Tokenizer,
                                                              tiny_model_factory) -> None:
    assert pick_parser(HARMONY_TEMPLATE) == "harmony" and pick_parser(CHAT_TEMPLATE) == "hermes"
    assert pick_reasoning_parser(CHAT_TEMPLATE, "harmony", tokenizer) is not None
    assert pick_reasoning_parser(HARMONY_TEMPLATE, "none", tokenizer) is None
    plain = Tokenizer(str(tiny_model_factory("gpt_oss")))  # no harmony markers
    assert pick_reasoning_parser(HARMONY_TEMPLATE, "auto", plain) is None
    with pytest.raises(ValueError, match="harmony's markers"):
        pick_reasoning_parser(HARMONY_TEMPLATE, "harmony", plain)
    assert ServerOptions(reasoning_parser="harmony").reasoning_parser == "harmony"


def test_calls_reach_the_tool_parser_whole_and_streamed(harmony: HarmonyTokens, tokenizer: Tokenizer) -> None:
    reply, reasoning, _, _ = CASES[2]
    ids = tokenizer.encode(reply, add_special_tokens=False)
    got_reasoning, content, calls = split_reply("", ids, harmony.parser([], tokenizer), ChannelCallParser())
    assert (got_reasoning, content) == (reasoning, None)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", CALL)]
    reasoner, parser = harmony.parser([], tokenizer), ChannelCallParser()
    streamed_reasoning, entries = "", []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = StreamDelta("", [token], [], last, "stop" if last else None, 1, i + 1, 0.0)
        part_reasoning, part_content, part_calls = split_delta(delta, reasoner, parser)
        streamed_reasoning += part_reasoning
        entries += part_calls
        assert part_content == ""
    assert streamed_reasoning == reasoning
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert entries[1] == {"index": 0, "function": {"arguments": CALL}}


# ---- end to end: the server and the official client

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
CHOICES = ["Paris", "Rome"]
END_BIAS = 3.0  # enough for the tiny model to end its analysis partway, not at once


@pytest.fixture(scope="module")
def forced_reply(model_dir: Path, tokenizer: Tokenizer, harmony: HarmonyTokens) -> tuple[str, str, int]:
    """The offline engine's reply under the same constraint and bias: (reasoning, answer, reasoning tokens)."""
    prompt = tokenizer.apply_chat_template(QUESTION)
    grammar = after_reasoning(StructuredOutputsParams(choice=CHOICES), harmony, "start", JSON_WHITESPACE)
    end_id = harmony.end_ids[0]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar, logit_bias={end_id: END_BIAS})
    llm = LLM(model=str(model_dir), reasoning_parser="auto")
    ids = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    opened, ended = ids.index(harmony.message_id), ids.index(end_id)
    # the test means something only if there is reasoning before the final channel
    assert ids[0] == harmony.channel_id and ended > opened + 1, tokenizer.decode(ids, skip_special_tokens=False)
    final = len(ids) - 1 - ids[::-1].index(harmony.message_id)
    reasoning, answer = tokenizer.decode(ids[opened + 1:ended]), tokenizer.decode(ids[final + 1:])
    [chat] = llm.chat(QUESTION, params, use_tqdm=False)  # LLM.chat splits it alike
    assert (chat.reasoning, chat.text) == (reasoning, answer)
    return reasoning, answer, ended - opened


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[openai.OpenAI]:
    with serve_app(build_app(served(EngineConfig(model=str(model_dir))), MODEL)) as url:
        yield openai_client(url)


def request(harmony: HarmonyTokens) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 40, "temperature": 0,
            "logit_bias": {str(harmony.end_ids[0]): END_BIAS}, "extra_body": {"structured_outputs": {"choice": CHOICES}}}


def test_the_server_splits_the_channels(client: openai.OpenAI, harmony: HarmonyTokens,
                                        forced_reply: tuple[str, str, int]) -> None:
    reasoning, answer, reasoning_tokens = forced_reply
    reply = client.chat.completions.create(**request(harmony))
    message = reply.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (reasoning, reasoning, answer)
    assert reply.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_the_server_streams_the_reasoning_then_the_answer(client: openai.OpenAI, harmony: HarmonyTokens,
                                                          forced_reply: tuple[str, str, int]) -> None:
    reasoning, answer, kinds, usage = split_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request(harmony)))
    assert (reasoning, answer, usage.completion_tokens_details.reasoning_tokens) == forced_reply
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)
