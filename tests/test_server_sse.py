"""A streamed chunk's bytes: the head every chunk of a reply shares, encoded once, around the choice
encoded for each chunk, read back as the JSON object the OpenAI API documents."""
from __future__ import annotations

import json

import pytest

from roseinfer.server.responses import Reply

CHOICE = {"index": 0, "text": 'a "quoted"\n\\ ünïcode 🙂 \x01', "logprobs": {"token_logprobs": [-0.25, -1e-07]},
          "finish_reason": None}


@pytest.mark.parametrize("include_usage, continuous", [(False, False), (True, False), (True, True)])
def test_a_chunk_is_the_reply_head_with_one_choice(include_usage: bool, continuous: bool) -> None:
    reply = Reply("cmpl-1", 1700000000, 'model "x"', "chat.completion", [3], include_usage, continuous)
    reply.completion_tokens[0] = 2
    raw = reply.chunk(CHOICE)
    assert raw.startswith(b"data: {") and raw.endswith(b"}\n\n") and raw.count(b"\n") == 2
    expected = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": 'model "x"',
                "choices": [CHOICE]}
    if include_usage:
        expected["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5} if continuous else None
    assert json.loads(raw[len(b"data: "):]) == expected
    tail = b"".join(reply.tail())
    assert tail.endswith(b"data: [DONE]\n\n") and (b'"usage":{"prompt_tokens":3' in tail) == include_usage
