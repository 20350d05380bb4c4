"""README.md's Python blocks run as written, against the default model they are written for.

One substitution, the server's address: the blocks say `http://127.0.0.1:8000`, what `make serve`
listens on, and the test's server (the default model served under `roseinfer serve`'s name, with
its defaults: sampled at temperature 1.0) listens on a free port. The blocks that talk to a server
run in order in one namespace, as a reader pastes them into one session; the Python API blocks then
run in another, in this process.

`ROSEINFER_README_RUNS=40 pytest tests/test_readme.py` runs the server blocks 40 times (each run
samples anew): the check behind the structured-output and tools examples."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import DEFAULT_SERVED_NAME
from server_helpers import serve_app

README = Path(__file__).resolve().parents[1] / "README.md"
README_ADDRESS = "http://127.0.0.1:8000"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.M | re.S)


def talks_to_a_server(block: str) -> bool:
    return "OpenAI(" in block or "Anthropic(" in block or "client." in block


def run_blocks(blocks: list[str], namespace: dict) -> None:
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # noqa: S102 -- the README's own code


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = python_blocks()
    server = [b for b in blocks if talks_to_a_server(b)]
    assert len(blocks) == 7 and len(server) == 5
    assert README_ADDRESS in server[0], "the substituted address must be the one the README gives"


@pytest.mark.slow
def test_the_readme_server_blocks_run_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = [b for b in python_blocks() if talks_to_a_server(b)]
    runs = int(os.environ.get("ROSEINFER_README_RUNS", "1"))
    with serve_app(build_app(LLMEngine(EngineConfig()), DEFAULT_SERVED_NAME)) as url:
        for _ in range(runs):
            namespace: dict = {}
            run_blocks([b.replace(README_ADDRESS, url) for b in blocks], namespace)
            assert isinstance(namespace["city"], namespace["City"]) and namespace["answer"] in ("yes", "no")
            assert [call.function.name for call in namespace["message"].tool_calls] == ["get_weather"]
            assert namespace["response"].status in ("completed", "incomplete") and namespace["response"].output_text
            follow_up = namespace["follow_up"]
            assert follow_up.previous_response_id == namespace["response"].id
            assert follow_up.usage.input_tokens > namespace["response"].usage.input_tokens
            assert namespace["reply"].stop_reason in ("end_turn", "max_tokens")
            assert namespace["streamed"].usage.output_tokens >= 1
    assert capsys.readouterr().out.count("\n") >= runs  # the tools example prints the final reply


@pytest.mark.slow
def test_the_readme_python_api_blocks_run_as_written() -> None:
    namespace: dict = {}
    run_blocks([b for b in python_blocks() if not talks_to_a_server(b)], namespace)
    assert len(namespace["outs"]) == 2 and namespace["outs"][0].finish_reason == "length"
    assert namespace["llm"].kv_cache_stats()["used_blocks"] == 0
    namespace["llm"].shutdown()
