"""Hybrid linear attention (Qwen3.5, Qwen3-Next, Qwen3.5-MoE: Gated DeltaNet layers beside gated full
attention) and its state pool: greedy output equal to HF fp32 in every scheduling mode, every slot and
block given back, and what hybrid models refuse (prefix caching, tensor parallelism). Speculative decoding:
tests/test_hybrid_speculative.py; the kernels against a float64 reference: tests/test_gated_delta_rule.py."""
from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import CPUBackend
from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import Scheduler
from roseinfer.engine.state_pool import StatePool
from tiny_models import HYBRID_ARCHS, hf_greedy, sample_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BACKENDS = ["torch"] + (["cpu"] if CPUBackend.supports(torch.device("cpu"), torch.float32) else [])
# name -> engine options. The conv keeps the last 3 inputs: budgets of 2 and 5 tokens cut prompts
# inside that window, so a chunk's conv reads the state the one before left.
MODES = {
    "default": {},
    "chunks_of_2": {"max_num_batched_tokens": 2},
    "chunks_of_5": {"max_num_batched_tokens": 5},
    "mixed_batches": {"max_num_batched_tokens": 24},  # decodes beside the next prompt's chunks
    "decode_first": {"decode_first": True, "max_num_batched_tokens": 16},
    "one_seq": {"max_num_seqs": 1},
}
# The MoE variants share the hybrid stack with qwen3_5 (which runs every mode) and the MoE block with
# tests/test_moe.py; they run the modes that cut chunks inside the conv window and mix batches, not the
# slowest two again (2-token chunks, one sequence at a time).
MOE_MODES = ("default", "chunks_of_5", "mixed_batches", "decode_first")
CASES = [(arch, mode) for arch in HYBRID_ARCHS for mode in MODES if arch == "qwen3_5" or mode in MOE_MODES]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def model_dir(request, tiny_model_factory) -> pathlib.Path:
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def references(model_dir) -> tuple[list[list[int]], list[list[int]]]:
    prompts = sample_prompts(model_dir, 5, seed=4, max_len=70)
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    assert all(len(set(r)) > 3 for r in refs), "degenerate reference"
    return prompts, refs


def _assert_all_free(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    assert stats["free_state_slots"] == stats["state_slots"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_dir, mode", CASES, indirect=["model_dir"])
def test_greedy_matches_hf(model_dir, references, backend: str, mode: str) -> None:
    prompts, refs = references
    llm = LLM(model=str(model_dir), attention_backend=backend, **{"num_kv_blocks": 128, **MODES[mode]})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs in mode {mode}"
    _assert_all_free(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preempted_requests_recompute_their_state(model_dir, backend: str) -> None:
    """Four 30-token prompts that each grow to 14 blocks of 4 in a pool of 20: requests are preempted
    mid-decode, give their slots back and recompute their state from their tokens."""
    text = max(sample_prompts(model_dir, 2, seed=9, max_len=120), key=len)
    prompts = [text[i * 30:(i + 1) * 30] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(model_dir), attention_backend=backend, num_kv_blocks=20, block_size=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 24) for p in prompts]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was not small enough to preempt"
    _assert_all_free(llm)


def test_triton_greedy_matches_hf_through_chunks(model_dir, references) -> None:
    """The full-attention layers through the Triton backend (under its interpreter on a CPU)."""
    device = pytest.importorskip("triton_interpret").backend_device()
    prompts, refs = references
    llm = LLM(model=str(model_dir), device=str(device), attention_backend="triton", num_kv_blocks=64,
              max_num_batched_tokens=5, dtype="float32")
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs[:3]
    _assert_all_free(llm)


def test_prefix_caching_is_refused_with_a_reason(model_dir, references, caplog) -> None:
    prompts, refs = references
    shared = prompts[0] + prompts[1][:5]
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(model_dir), num_kv_blocks=128, enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text
    outs = llm.generate([prompts[0]], GREEDY, use_tqdm=False) + llm.generate([shared], GREEDY, use_tqdm=False)
    assert outs[0].token_ids == refs[0] and outs[1].token_ids == hf_greedy(model_dir, shared, MAX_TOKENS)
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 0 and outs[1].num_cached_tokens == 0


def test_tensor_parallelism_is_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="runs on one rank: tensor_parallel_size must be 1"):
        LLM(model=str(model_dir), num_kv_blocks=32, tensor_parallel_size=2)


def test_multimodal_folder_loads_its_text_model(model_dir, references, tmp_path) -> None:
    """A Qwen3.5 (or Qwen3.5-MoE) multimodal checkpoint: the text config under text_config, the text
    weights under model.language_model.*; the vision tower and the multi-token-prediction head are
    skipped. Qwen3-Next has no multimodal checkpoint."""
    wrapper_type = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
    text = json.loads((model_dir / "config.json").read_text())
    if text["model_type"] not in wrapper_type:
        pytest.skip(f"{text['model_type']} has no multimodal checkpoint")
    for item in model_dir.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            (tmp_path / item.name).write_bytes(item.read_bytes())
    wrapper = {"model_type": wrapper_type[text["model_type"]], "text_config": {k: v for k, v in text.items() if k != "model_type"},
               "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
               for name, t in load_file(model_dir / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    prompts, refs = references
    outs = LLM(model=str(tmp_path), num_kv_blocks=64).generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs[:2]


def test_admission_waits_for_a_free_state_slot() -> None:
    """Blocks to spare but two slots: two requests run, the others wait; finishing, aborting and
    preemption each give a slot back."""
    manager = BlockManager(64, 4, enable_prefix_caching=False, state_pool=StatePool(2))
    scheduler = Scheduler(EngineConfig(model="unused", max_num_seqs=8), manager, 256, eos_token_ids={0})
    reqs = [Request(f"r{i}", list(range(1, 10)), SamplingParams(max_tokens=4)) for i in range(4)]
    for req in reqs:
        scheduler.add_request(req)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert {reqs[0].state_slot, reqs[1].state_slot} == {0, 1} and manager.state_pool.num_free_slots == 0
    assert reqs[2].state_slot is None and not reqs[2].block_table  # it waits with nothing held
    scheduler.abort(reqs[0])
    assert reqs[0].state_slot is None and manager.state_pool.num_free_slots == 1
    scheduler._preempt(reqs[1])
    assert reqs[1].state_slot is None and manager.state_pool.num_free_slots == 2
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r1", "r2"]
    for req in list(scheduler.running) + list(scheduler.waiting):
        scheduler.abort(req)
    assert manager.state_pool.num_free_slots == 2 and manager.num_used_blocks == 0


def test_state_pool_and_kv_pool_share_one_budget(model_dir) -> None:
    """With --kv-cache-memory-gb, the slots come first (one per sequence within half the budget) and
    the KV pool, for the full-attention layer only, takes what is left."""
    from roseinfer.worker.model_runner import ModelRunner

    budget_gb = 0.0005  # 512 KiB: 15 slots of this model (16.5 KiB each) in its half, 132 blocks in the rest
    llm = LLM(model=str(model_dir), kv_cache_memory_gb=budget_gb, max_num_seqs=64)
    engine = llm.engine
    slot_bytes = ModelRunner.state_bytes_per_slot(engine.model_config, torch.float32)
    block_bytes = ModelRunner.kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32)
    stats = llm.kv_cache_stats()
    budget = int(budget_gb * 2**30)
    assert stats["state_slots"] == budget // 2 // slot_bytes < 64
    assert stats["total_blocks"] == (budget - stats["state_slots"] * slot_bytes) // block_bytes
    assert engine.model_config.num_kv_layers == 1 and block_bytes == 2 * 16 * 2 * 32 * 4
    # twice the slots in requests: the second half waits for slots, not blocks, and nobody is preempted
    prompts = sample_prompts(model_dir, 2 * stats["state_slots"], seed=2, max_len=20)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs[:3]] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts[:3]]
    assert max(o.metrics["num_preemptions"] for o in outs) == 0
    _assert_all_free(llm)
