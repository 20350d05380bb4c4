"""reasoning.py on text and token sequences: where a reply starts (from the prompt's tail
and the parser's kind), the split of reasoning from the answer whole and streamed in every way the
tags can be cut, reasoning tokens, which templates and tokenizers get a parser, and tool calls read
from the answer only."""
from __future__ import annotations

from pathlib import Path

import pytest

from roseinfer.reasoning import ReasoningDelta, ReasoningParser, ThinkTags, pick_reasoning_parser
from roseinfer.server.tool_parsers import HermesParser
from roseinfer.tokenizer import Tokenizer
from server_helpers import model_copy
from thinking_model import OPEN_THINKING_TEMPLATE, QWEN3_THINKING_TEMPLATE, build_thinking_model
from tiny_models import CHAT_TEMPLATE

START_ID, END_ID, WORD_ID = 384, 385, 7
QWEN3 = ThinkTags("qwen3", START_ID, END_ID)
R1 = ThinkTags("deepseek_r1", START_ID, END_ID)
# (reply, where it starts, reasoning, content)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", "qwen3", "Let me see.", "Paris."),
    ("  <think>a</think>b", "qwen3", "a", "b"),
    ("Paris.", "qwen3", None, "Paris."),
    ("Paris </think> is it", "qwen3", None, "Paris </think> is it"),  # no <think> first: all answer
    ("<think>unfinished", "qwen3", "unfinished", None),
    ("<think>cut off at </thi", "qwen3", "cut off at </thi", None),
    ("a</think>b</think>c", "deepseek_r1", "a", "b</think>c"),  # only the first </think> ends it
    ("<think>a</think>b", "deepseek_r1", "a", "b"),
    ("no tags at all", "deepseek_r1", "no tags at all", None),
    ("</think>\n\nonly answer", "deepseek_r1", None, "only answer"),
    ("a < b <thing> </thinking> c", "deepseek_r1", "a < b <thing> </thinking> c", None),
]


def parser(start: str) -> ReasoningParser:
    """A parser for a reply whose prompt did not say where it starts."""
    return ReasoningParser(R1 if start == "deepseek_r1" else QWEN3, "start",
                           "reasoning" if start == "deepseek_r1" else "content")


def streamed(p: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    out = ReasoningDelta()
    for piece in pieces:
        out.extend(p.feed(piece))
    out.extend(p.finish())
    return out.reasoning or None, out.content or None


@pytest.mark.parametrize("text,start,reasoning,content", CASES)
def test_a_whole_reply_splits_into_reasoning_and_answer(text: str, start: str, reasoning: str | None,
                                                         content: str | None) -> None:
    assert parser(start).parse(text) == (reasoning, content)


@pytest.mark.parametrize("text,start,reasoning,content", CASES)
def test_a_stream_split_anywhere_gives_the_whole_replys_split(text: str, start: str, reasoning: str | None,
                                                               content: str | None) -> None:
    for cut in range(len(text) + 1):  # every cut in two, tags included
        assert streamed(parser(start), [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert streamed(parser(start), list(text)) == (reasoning, content)  # one character at a time


def test_a_stream_shows_reasoning_before_the_end_tag_arrives() -> None:
    p = parser("qwen3")
    assert p.feed("<thi") == ReasoningDelta()  # maybe the tag: held
    assert p.feed("nk>\nstep one") == ReasoningDelta(reasoning="step one")
    assert p.feed("\n</") == ReasoningDelta()  # whitespace and maybe the end tag: held
    assert p.feed("b") == ReasoningDelta(reasoning="\n</b")  # not the tag after all
    assert p.feed("</think>\n\nAns") == ReasoningDelta(content="Ans")
    assert p.feed("wer\n") == ReasoningDelta(content="wer\n")
    assert p.finish() == ReasoningDelta()


class PromptTail:
    """Stands in for the tokenizer that decodes a prompt's tail."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.text


@pytest.mark.parametrize("tags", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_the_prompts_tail_says_where_the_reply_starts(tags: ThinkTags) -> None:
    opened = tags.parser([1], PromptTail("<|im_start|>assistant\n<think>\n"))
    assert opened.parse("thinking</think>answer") == ("thinking", "answer")
    closed = tags.parser([1], PromptTail("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert closed.mode == "content"
    assert closed.parse("answer </think> with a tag") == (None, "answer </think> with a tag")
    plain = tags.parser([1], PromptTail("<|im_start|>assistant\n"))
    assert plain.parse("words") == (("words", None) if tags.kind == "deepseek_r1" else (None, "words"))


def test_reasoning_tokens_are_those_between_the_tags() -> None:
    p = parser("qwen3")
    p.feed("<think>", [START_ID])
    p.feed("a b c", [WORD_ID, WORD_ID, WORD_ID])
    assert p.reasoning_tokens == 3
    p.feed("</think>answer", [END_ID, WORD_ID, WORD_ID])
    assert p.reasoning_tokens == 3
    answer_only = parser("qwen3")
    answer_only.parse("a </think> b", [WORD_ID, END_ID, WORD_ID])
    assert answer_only.reasoning_tokens == 0
    opened = ReasoningParser(QWEN3, "reasoning", "reasoning")
    opened.parse("a b", [WORD_ID, WORD_ID])  # cut off before </think>: all of it was reasoning
    assert opened.reasoning_tokens == 2
    closed = ReasoningParser(QWEN3, "content", "content")
    closed.parse("<think>a</think>", [START_ID, WORD_ID, END_ID])
    assert closed.reasoning_tokens == 0


def test_tool_calls_are_read_from_the_answer_only() -> None:
    """What serving.py does: the tool parser gets the reasoning parser's content."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    reasoning, content = parser("qwen3").parse(f"<think>maybe {call.replace('UTC', 'CET')}</think>\n\n{call}")
    assert "CET" in reasoning
    text, calls = HermesParser().parse(content)
    assert text is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_model(tmp_path_factory.mktemp("thinking") / "qwen3")


def test_auto_picks_qwen3_for_a_thinking_template_whose_tokenizer_has_the_tags(thinking_model: Path,
                                                                             tokenizer_dir: Path,
                                                                             tmp_path: Path) -> None:
    tokenizer = Tokenizer(str(thinking_model))
    for template in (QWEN3_THINKING_TEMPLATE, OPEN_THINKING_TEMPLATE):
        assert pick_reasoning_parser(template, "auto", tokenizer) == QWEN3
    assert pick_reasoning_parser(CHAT_TEMPLATE, "auto", tokenizer) is None
    assert pick_reasoning_parser(QWEN3_THINKING_TEMPLATE, "none", tokenizer) is None
    assert pick_reasoning_parser(CHAT_TEMPLATE, "deepseek_r1", tokenizer) == R1
    # the plain tiny tokenizer spells the tags in several tokens: no parser, or a clear error when asked for one
    plain = Tokenizer(str(model_copy(tokenizer_dir, tmp_path / "plain", chat_template=QWEN3_THINKING_TEMPLATE)))
    assert pick_reasoning_parser(plain.chat_template, "auto", plain) is None
    with pytest.raises(ValueError, match="--reasoning-parser qwen3 needs <think> and </think>"):
        pick_reasoning_parser(plain.chat_template, "qwen3", plain)


@pytest.mark.parametrize("kind, mode, reply, accepted", [
    ("qwen3", "reasoning", "a b</think>{\"a\": 1}", True),
    ("qwen3", "reasoning", "{\"a\": 1}", False),  # the answer comes only after </think>
    ("qwen3", "start", "{\"a\": 1}", True),  # a qwen3 reply that does not open <think> is all answer
    ("qwen3", "start", "<think>a</think>{\"a\": 1}", True),
    ("qwen3", "start", "a</think>{\"a\": 1}", False),
    ("deepseek_r1", "start", "a</think>{\"a\": 1}", True),  # R1's reasoning, opened or not
    ("deepseek_r1", "start", "<think>a</think>{\"a\": 1}", True),
])
def test_a_constraint_after_the_reasoning_lets_the_reasoning_through(tmp_path: Path, kind: str, mode: str,
                                                                     reply: str, accepted: bool) -> None:
    from roseinfer.engine.structured_output import JSON_WHITESPACE, GrammarCompiler
    from roseinfer.sampling_params import StructuredOutputsParams
    from roseinfer.reasoning import after_reasoning

    tokenizer = Tokenizer(str(build_thinking_model(tmp_path / "qwen3")))
    tags = pick_reasoning_parser(QWEN3_THINKING_TEMPLATE, kind, tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = after_reasoning(StructuredOutputsParams(json=schema), tags, mode, JSON_WHITESPACE)
    compiler = GrammarCompiler(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile(params).matcher()
    ids = tokenizer.encode(reply, add_special_tokens=False)
    taken = all(matcher.accept(token) for token in ids)
    assert (taken and matcher.is_complete) == accepted
    with pytest.raises(ValueError, match="regex constraint cannot be put after the reasoning"):
        after_reasoning(StructuredOutputsParams(regex="a+"), tags, mode, JSON_WHITESPACE)
