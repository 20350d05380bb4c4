"""The offline API's chat() and progress bar (vLLM's LLM.chat and use_tqdm)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from roseinfer import LLM, SamplingParams
from server_helpers import model_copy
from thinking_model import OPEN_THINKING_TEMPLATE, build_thinking_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "Where do penguins live?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Light scatters."}, {"role": "user", "content": "More?"}],
]
# the tiny model's ChatML template, plus a variable that only chat_template_kwargs can set
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=64)


def _with_template(model_dir: Path, dst: Path, template: str | None) -> Path:
    shutil.copytree(model_dir, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_chat_equals_generate_on_the_templated_prompt(llm: LLM) -> None:
    templated = [llm.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]
    # the generation prompt is there
    assert all(llm.tokenizer.decode(t, skip_special_tokens=False).endswith("<|im_start|>assistant\n") for t in templated)
    expected = llm.generate(templated, GREEDY, use_tqdm=False)
    one = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    both = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(both) == 2
    assert one[0].prompt_token_ids == templated[0] and one[0].token_ids == expected[0].token_ids
    assert [o.prompt_token_ids for o in both] == templated
    assert [o.token_ids for o in both] == [o.token_ids for o in expected]
    plain = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert plain.prompt_token_ids == llm.tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False)
    assert plain.prompt_token_ids != templated[0]
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_chat_template_kwargs_reach_the_template(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(_with_template(model_dir, tmp_path / "thinking", THINKING_TEMPLATE)), num_kv_blocks=16)
    default = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)[0].prompt_token_ids
    off = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert llm.tokenizer.decode(off.prompt_token_ids, skip_special_tokens=False).endswith("<think></think>")
    assert off.prompt_token_ids[:len(default)] == default and len(off.prompt_token_ids) > len(default)


def test_chat_without_a_template_is_a_value_error(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(_with_template(model_dir, tmp_path / "plain", None)), num_kv_blocks=16)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_progress_bar_shows_only_with_use_tqdm(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    llm.generate(prompts, GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "est. speed input:" in err and "toks/s" in err
    llm.chat(CONVERSATIONS, GREEDY)
    assert "2/2" in capsys.readouterr().err
    llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_chat_with_a_reasoning_parser_splits_the_reasoning_from_the_answer(model_dir: Path, tmp_path: Path) -> None:
    """The split of the reply generate() writes for the templated prompt (the server's split: see
    test_server_reasoning.py); a bias on </think> makes the tiny model close its reasoning partway."""
    model_dir = model_copy(build_thinking_model(tmp_path / "qwen3"), tmp_path / "open",
                           chat_template=OPEN_THINKING_TEMPLATE)
    llm = LLM(str(model_dir), num_kv_blocks=64, reasoning_parser="auto")
    end_id = llm.tokenizer.encode("</think>", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias={end_id: 3.0})
    [out] = llm.chat(CONVERSATIONS[0], params, use_tqdm=False)
    [raw] = llm.generate(llm.apply_chat_template(CONVERSATIONS[0]), params, use_tqdm=False)
    assert "</think>" in raw.text, "the tiny thinker never closed its reasoning"
    reasoning, answer = raw.text.split("</think>", 1)
    assert (out.reasoning, out.text) == (reasoning.strip(), answer.lstrip())
    assert out.token_ids == raw.token_ids and raw.reasoning is None
    with pytest.raises(ValueError, match="--reasoning-parser must be auto, none or one of"):
        LLM(str(model_dir), num_kv_blocks=8, reasoning_parser="granite")
