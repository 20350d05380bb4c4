"""Embeddings through the engine (LLM.embed): a prompt's final hidden state (after the model's last
norm) pooled, equal to HF transformers' last_hidden_state of the same checkpoint in fp32.

The bound, 1e-5 on unit vectors (1e-4 relative on raw hidden states), covers the engine's other
order of fp32 sums (its kernels' matmul and attention blocking, a mean's sum over chunks) across a
few layers; a wrong row, position or norm is off by orders of magnitude more."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from roseinfer import LLM, PoolingParams, SamplingParams
from tiny_models import hf_greedy, load_hf_model

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Paris is the capital of France, and " * 6]
ATOL = 1e-5


@torch.no_grad()
def hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF's final hidden states of one prompt, [tokens, hidden]."""
    return load_hf_model(model_dir).base_model(torch.tensor([ids])).last_hidden_state[0].float()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tiny_model_factory) -> Path:
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    # a small token budget: the longest prompt is prefilled in several chunks
    return LLM(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=16)


def test_last_token_pooling_is_hfs_last_hidden_state_normalized(llm: LLM, model_dir: Path) -> None:
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(outputs[2].prompt_token_ids) > 16, "the long prompt must need several chunks"
    for out in outputs:
        expected = torch.nn.functional.normalize(hf_hidden(model_dir, out.prompt_token_ids)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=0)
    assert llm.kv_cache_stats()["used_blocks"] == 0  # no KV is kept for an embedding request


def test_mean_pooling_averages_every_token_over_the_chunks(llm: LLM, model_dir: Path) -> None:
    llm.embed(PROMPTS[2], use_tqdm=False)  # its blocks are in the prefix cache now: mean pooling must not use them
    [out] = llm.embed(PROMPTS[2], PoolingParams(pooling="mean"), use_tqdm=False)
    expected = torch.nn.functional.normalize(hf_hidden(model_dir, out.prompt_token_ids).mean(dim=0), dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=0)


def test_without_normalization_the_vector_is_the_hidden_state(llm: LLM, model_dir: Path) -> None:
    [out] = llm.embed([llm.tokenizer.encode(PROMPTS[0])], PoolingParams(normalize=False), use_tqdm=False)
    expected = hf_hidden(model_dir, out.prompt_token_ids)[-1]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=1e-4)


def test_embedding_and_generation_share_steps_without_changing_either(llm: LLM, model_dir: Path) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[0])
    generated = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    embedded = engine.new_request(PROMPTS[1], pooling_params=PoolingParams())
    engine.core.add(embedded)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.pop_finished_ids()
    tokens = [t for o in outputs if o.request_id == generated for t in o.new_token_ids]
    assert tokens == hf_greedy(model_dir, ids, 8)
    [final] = [o for o in outputs if o.request_id == embedded.request_id]
    assert final.new_token_ids == [] and final.finish_reason == "stop"
    expected = torch.nn.functional.normalize(hf_hidden(model_dir, embedded.prompt_token_ids)[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(final.embedding), expected, atol=ATOL, rtol=0)


def test_pooling_is_checked() -> None:
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        PoolingParams(pooling="max")  # type: ignore[arg-type]


def sentence_transformers_copy(model_dir: Path, out: Path, pooling: dict[str, bool], normalize: bool) -> Path:
    """The checkpoint with sentence-transformers' modules.json and 1_Pooling/config.json."""
    shutil.copytree(model_dir, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return out


@pytest.mark.parametrize("mode, normalize", [("mean", True), ("cls", False)])
def test_the_checkpoints_sentence_transformers_pooling_is_the_default(model_dir: Path, tmp_path: Path, mode: str,
                                                                      normalize: bool) -> None:
    flag = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}[mode]
    folder = sentence_transformers_copy(model_dir, tmp_path / "st", {flag: True, "pooling_mode_lasttoken": False},
                                        normalize)
    llm = LLM(str(folder), num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.pooling_defaults == PoolingParams(mode, normalize)
    [out] = llm.embed(PROMPTS[2], use_tqdm=False)
    hidden = hf_hidden(model_dir, out.prompt_token_ids)
    expected = hidden.mean(dim=0) if mode == "mean" else hidden[0]
    if normalize:
        expected = torch.nn.functional.normalize(expected, dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=1e-4)


def test_a_sentence_transformers_pooling_roseinfer_lacks_is_refused(model_dir: Path, tmp_path: Path) -> None:
    folder = sentence_transformers_copy(model_dir, tmp_path / "st", {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        LLM(str(folder), num_kv_blocks=8)


def matryoshka_copy(model_dir: Path, out: Path, **keys: object) -> Path:
    """The checkpoint with vLLM's Matryoshka keys added to its config.json."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **keys}))
    return out


def test_matryoshka_dimensions_keep_the_first_values_then_normalize(model_dir: Path, tmp_path: Path) -> None:
    folder = matryoshka_copy(model_dir, tmp_path / "mrl", matryoshka_dimensions=[16, 32])
    llm = LLM(str(folder), num_kv_blocks=64)
    [out] = llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    hidden = hf_hidden(model_dir, out.prompt_token_ids)[-1]
    expected = torch.nn.functional.normalize(hidden[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=0)
    for size in (24, hidden.numel() + 16):  # not a trained size; longer than the vector
        with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32, 64\]"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=size), use_tqdm=False)
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_any_dimensions_up_to_the_hidden_size_where_the_checkpoint_is_matryoshka(model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    llm = LLM(str(matryoshka_copy(model_dir, tmp_path / "mrl", is_matryoshka=True)), num_kv_blocks=64)
    [out] = llm.embed(PROMPTS[1], PoolingParams(normalize=False, dimensions=5), use_tqdm=False)
    expected = hf_hidden(model_dir, out.prompt_token_ids)[-1][:5]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions must be at most 64"):
        llm.embed(PROMPTS[1], PoolingParams(dimensions=65), use_tqdm=False)


def test_dimensions_other_than_the_hidden_size_are_refused_without_matryoshka(llm: LLM) -> None:
    with pytest.raises(ValueError, match="declares no shorter"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    [out] = llm.embed(PROMPTS[0], PoolingParams(dimensions=llm.engine.model_config.hidden_size), use_tqdm=False)
    assert len(out.outputs.embedding) == llm.engine.model_config.hidden_size
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)
