"""Tool-call parsers (roseinfer/server/tool_parsers.py): whole outputs, and the same outputs streamed
in arbitrary splits, which must give the same content and the same calls."""
from __future__ import annotations

import json
import random

import pytest

from roseinfer.server.tool_parsers import JsonScan, NamedCallParser, ToolParser, format_calls, make_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def whole(kind: str, text: str, max_calls: int | None = None) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = make_parser(kind, max_calls).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """Content, calls as a client accumulates them from the deltas, and the raw delta entries."""
    content, entries = "", []
    for piece in pieces:
        delta = parser.feed(piece)
        content, entries = content + delta.content, entries + delta.tool_calls
    delta = parser.finish()
    content, entries = content + delta.content, entries + delta.tool_calls
    calls: dict[int, list[str]] = {}
    for entry in entries:
        name_args = calls.setdefault(entry["index"], ["", ""])
        name_args[0] += entry["function"].get("name", "")
        name_args[1] += entry["function"].get("arguments", "")
    return (content if content.strip() else None), [tuple(v) for v in calls.values()], entries


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
     "Let me look.", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]),
    # Qwen may end on EOS without the closing tag; arguments given as a JSON string are read as JSON
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", {"x": 1})]),
    ("hermes", "no calls here, just a < sign and <tool", "no calls here, just a < sign and <tool", []),
    ("hermes", "a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
    ("hermes", f'<tool_call>{{"arguments": {{}}}}</tool_call><tool_call>{TIME}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', [("get_time", {"zone": "CET"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"s": "};{"}}; {"name": "b", "parameters": {}}', None,
     [("a", {"s": "};{"}), ("b", {})]),
    ("llama3_json", '{"name": "a", "parameters": {}} and then some words', "and then some words", [("a", {})]),
    ("llama3_json", 'The answer is {"name": "a", "parameters": {}}', 'The answer is {"name": "a", "parameters": {}}',
     []),
    ("llama3_json", ' {"city": "Paris"}', ' {"city": "Paris"}', []),
    ("llama3_json", '{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    ("required", '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":"]"}}]', None,
     [("a", {"x": 1}), ("b", {"y": "]"})]),
    ("required", '[ {"name": "a", "parameters": {}} ]', None, [("a", {})]),
]


@pytest.mark.parametrize("kind,text,content,calls", CASES)
def test_whole_output(kind: str, text: str, content: str | None, calls: list) -> None:
    assert whole(kind, text) == (content, calls)


@pytest.mark.parametrize("kind,text,content,calls", CASES)
def test_any_split_of_a_stream_gives_the_whole_outputs_calls(kind: str, text: str, content: str | None,
                                                             calls: list) -> None:
    rng = random.Random(text)
    expected = [(c.name, c.arguments) for c in make_parser(kind).parse(text)[1]]
    for pieces in [list(text), [text], *(random_splits(text, rng) for _ in range(60))]:
        got_content, got_calls, entries = streamed(make_parser(kind), pieces)
        assert (got_content, got_calls) == (content, expected), pieces
        firsts = [e for e in entries if "id" in e]
        assert [e["index"] for e in firsts] == list(range(len(calls)))
        assert all(e["id"].startswith("call_") and e["type"] == "function" and e["function"]["arguments"] == ""
                   for e in firsts)


def test_no_part_of_a_call_leaks_as_content_while_streaming() -> None:
    parser = make_parser("hermes")
    text = f"Checking. <tool_call>\n{WEATHER}\n</tool_call>"
    shown = ""
    for ch in text:
        shown += parser.feed(ch).content
        assert "<" not in shown, shown
    assert shown == "Checking."


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    assert whole("hermes", text, max_calls=1) == (None, [("get_weather", {"city": "Paris", "unit": "c"})])


def test_named_function_output_is_its_arguments_streamed_as_they_come() -> None:
    parser = NamedCallParser("get_weather")
    first = parser.feed('{"city": ')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first.tool_calls[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    assert parser.feed('"Paris"}').tool_calls == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert parser.finish().tool_calls == []
    assert parser.calls[0].arguments == '{"city": "Paris"}' and parser.content == ""
    empty = NamedCallParser("f")
    assert empty.finish().tool_calls[0]["function"] == {"name": "f", "arguments": ""}


def test_format_calls_reads_back_as_the_same_calls() -> None:
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    for kind in ("hermes", "llama3_json"):
        assert whole(kind, format_calls(kind, calls)) == (None, [(c["name"], c["arguments"]) for c in calls])


def test_json_scan_ignores_brackets_in_strings_and_resumes_where_it_stopped() -> None:
    assert JsonScan().end('{"a": "}\\"]"} tail') == len('{"a": "}\\"]"}')
    assert JsonScan().end('[{"a": [1, 2]}, {}]x') == len('[{"a": [1, 2]}, {}]')
    scan, text = JsonScan(), '{"a": "}\\"]", "b": [{}]}'
    assert [scan.end(text[:i]) for i in range(1, len(text))] == [None] * (len(text) - 1)
    assert scan.end(text) == len(text) and scan.pos == len(text)


def test_a_long_call_streamed_in_small_deltas_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    text = '[{"name": "write", "parameters": {"body": "' + "x" * 200_000 + '"}}]'
    parser = make_parser("required")
    examined: list[int] = []  # characters each look at the text reads
    real_end = JsonScan.end

    def end(scan: JsonScan, seen: str) -> int | None:
        examined.append(len(seen) - scan.pos)
        return real_end(scan, seen)

    monkeypatch.setattr(JsonScan, "end", end)
    for i in range(0, len(text), 4):
        parser.feed(text[i:i + 4])
    parser.finish()
    assert len(parser.calls) == 1
    assert len(examined) > 1000 and sum(examined) <= len(text)  # a rescan per delta would read ~len²/8


def test_unknown_parser_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_parser("mistral")
