"""roseinfer generate / chat / --help on a tiny model, through the real entry point."""
from __future__ import annotations

import io
import re
import socket
import subprocess
import sys

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.cli import main


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _expected(model_dir: str, messages: list[dict]) -> tuple[str, str]:
    """The greedy reply and its finish reason."""
    llm = LLM(model=model_dir, num_kv_blocks=32)
    ids = llm.apply_chat_template(messages)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6))[0]
    return out.text, out.finish_reason


def test_generate_prints_the_greedy_completion(model_dir, capsys):
    assert main(["generate", "hello there", "--model", model_dir, "--max-tokens", "6", "--num-kv-blocks", "32"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == _expected(model_dir, [{"role": "user", "content": "hello there"}])[0]
    assert "finish_reason=" in out.err


def test_chat_streams_each_turn_and_keeps_the_history(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n"))
    assert main(["chat", "--model", model_dir, "--max-tokens", "6", "--num-kv-blocks", "32"]) == 0
    first, first_reason = _expected(model_dir, [{"role": "user", "content": "hello there"}])
    second, second_reason = _expected(model_dir, [{"role": "user", "content": "hello there"},
                                                  {"role": "assistant", "content": first},
                                                  {"role": "user", "content": "and again"}])
    out = capsys.readouterr()
    assert out.out == f"> {first}\n> {second}\n> "
    # a reply cut at --max-tokens says so, one that ended on its own does not
    assert out.err.count("[reply cut at --max-tokens 6]") == [first_reason, second_reason].count("length")


def test_stop_ends_the_output_where_the_text_first_appears(model_dir, capsys, monkeypatch):
    argv = ["generate", "hello there", "--model", model_dir, "--max-tokens", "24", "--num-kv-blocks", "32"]
    assert main(argv) == 0
    full = capsys.readouterr().out.rstrip("\n")
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert main(argv + ["--stop", "never-seen-xyz", "--stop", stop]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == full[:full.index(stop)] and "finish_reason=stop" in out.err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    assert main(["chat"] + argv[2:] + ["--stop", stop]) == 0  # the chat's reply to the same prompt, cut alike
    assert capsys.readouterr().out == f"> {full[:full.index(stop)]}\n> "


def test_bad_input_is_one_line_and_exit_code_2(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roseinfer: error: max_tokens") and err.count("\n") == 1


def test_generate_takes_a_structured_output_constraint(model_dir, capsys):
    argv = ["generate", "hi", "--model", model_dir, "--max-tokens", "20", "--num-kv-blocks", "32",
            "--structured-outputs", '{"regex": "[a-c]{3}-[0-9]{2}"}']
    assert main(argv) == 0
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", capsys.readouterr().out.rstrip("\n"))
    for spec, message in (('{"regex": "[a-"}', "cannot be compiled"), ("[1]", "must be a JSON object"),
                          ('{"pattern": "x"}', "unexpected keyword argument 'pattern'"), ("{", "not valid JSON")):
        assert main(argv[:-1] + [spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith("roseinfer: error: ") and message in err and err.count("\n") == 1, err


def test_serve_on_a_port_in_use_fails_before_loading_the_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a model that does not exist: the port must be the first thing checked
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
    assert capsys.readouterr().err == f"roseinfer: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_mistyped_local_path_is_not_reported_as_a_hub_failure_alone(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "hi", "--model", "nope_dir"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roseinfer: error: nope_dir: no such file or folder here, and no Hugging Face hub repo")
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["chat", "--help"], ["serve", "--help"],
                                  ["bench", "offline", "--help"]])
def test_help_is_useful_on_its_own(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: roseinfer" in out
    # each flag states its default once, and never as a bare None
    flat = " ".join(out.split())
    assert "(default: None)" not in flat
    assert not re.search(r"\(default[^)]*\)\s*\(default", flat)


def test_building_the_parser_leaves_the_server_and_http_client_unimported():
    # Every command builds the whole parser; generate, chat and bench offline must not carry the
    # server's and the HTTP bench's imports (~25 MiB resident) into their processes.
    code = ("import sys; from roseinfer.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_serve_takes_the_api_key_from_the_environment(monkeypatch, capsys):
    from roseinfer.cli import build_parser
    from roseinfer.server.args import server_options

    monkeypatch.setenv("ROSEINFER_API_KEY", "sk-from-env")
    assert server_options(build_parser().parse_args(["serve"])).api_key == "sk-from-env"
    assert server_options(build_parser().parse_args(["serve", "--api-key", "sk-flag"])).api_key == "sk-flag"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--api-key" in help_text and "sk-from-env" not in help_text  # the key never shows in --help
    monkeypatch.delenv("ROSEINFER_API_KEY")
    assert server_options(build_parser().parse_args(["serve"])).api_key is None


def test_serve_takes_the_responses_store_bounds():
    from roseinfer.cli import build_parser
    from roseinfer.server.args import ServerOptions, server_options

    options = server_options(build_parser().parse_args(["serve", "--responses-store-size", "0",
                                                        "--responses-store-mb", "0.5"]))
    assert options.responses_store_size == 0 and options.responses_store_bytes == 2**19
    assert ServerOptions().responses_store_size == 1000
    for bad in ({"responses_store_size": -1}, {"responses_store_mb": 0}):
        with pytest.raises(ValueError, match="--responses-store"):
            ServerOptions(**bad)
