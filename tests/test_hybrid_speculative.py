"""Speculative decoding on hybrid models (Qwen3.5, Qwen3-Next, Qwen3.5-MoE): a verified draft keeps
each linear layer's state after every position and the accepted one is committed, so greedy output
equals HF fp32 token for token however many draft tokens are rejected; the verify step's recurrence
gives the very floats plain decode gives; state slots and KV blocks are all free afterwards."""
from __future__ import annotations

import functools
import pathlib

import pytest
import torch
from tiny_models import HYBRID_ARCHS, hf_greedy, sample_prompts

from roseinfer import LLM, SamplingParams
from roseinfer.backends import select_backend
from roseinfer.backends.base import BatchLayout
from roseinfer.backends.cpu import CPUBackend
from roseinfer.distributed.parallel import SINGLE
from roseinfer.engine import speculative
from roseinfer.layers.gated_delta_rule import LinearStateBatch
from roseinfer.loader.model_loader import load_model_config
from roseinfer.models.qwen3_5 import GatedDeltaNet

MAX_TOKENS = 20
K = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 8}  # batches draft too
BACKENDS = ["torch"] + (["cpu"] if CPUBackend.supports(torch.device("cpu"), torch.float32) else [])
# name -> engine options; the conv keeps the last 3 inputs, so 5-token chunks cut it
MODES = {
    "alone": {"max_num_seqs": 1},
    "mixed_batches": {"max_num_batched_tokens": 24},  # verified drafts beside the next prompts' chunks
    "chunks_of_5": {"max_num_batched_tokens": 5},  # drafts cut to the budget beside chunked prompts
    "preemption": {"num_kv_blocks": 20, "block_size": 4},
}
# qwen3_5 runs every mode on both backends; the others share its stack and run two
CASES = [(arch, mode) for arch in HYBRID_ARCHS for mode in MODES
         if arch == "qwen3_5" or mode in ("mixed_batches", "preemption")]


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@functools.cache
def _references(model_dir: pathlib.Path) -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts of 30 tokens, long enough that four of them preempt in a pool of 20 blocks of 4."""
    text = max(sample_prompts(model_dir, 2, seed=9, max_len=120), key=len)
    prompts = [text[i * 30:(i + 1) * 30] for i in range(4)]
    return prompts, [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]


@pytest.fixture
def references(model_dir) -> tuple[list[list[int]], list[list[int]]]:
    # cached by folder: an indirectly parametrized model_dir sets its module fixtures up again per case
    return _references(model_dir)


@pytest.fixture
def oracle_drafts(monkeypatch, references) -> list[int]:
    """Drafts of HF's own continuation with one token changed, at position 0, 1, ... K - 1 in turn and
    none every (K + 1)-th time, so the target accepts 0, 1, ... K of them: every depth of rollback,
    and a draft taken whole. Returns the accepted count of each verification as they come."""
    prompts, refs = references
    whole = [p + r for p, r in zip(prompts, refs)]
    turn = iter(range(10**9))
    accepted: list[int] = []

    def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
        full = next(w for w in whole if w[:len(tokens)] == tokens)
        draft = full[len(tokens):len(tokens) + k]
        wrong = next(turn) % (K + 1)
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % 256
        return draft

    record = speculative.Proposer.record

    def counting(self, req, num_proposed: int, num_accepted: int) -> None:
        accepted.append(num_accepted)
        record(self, req, num_proposed, num_accepted)

    monkeypatch.setattr(speculative, "ngram_lookup", lookup)
    monkeypatch.setattr(speculative.Proposer, "record", counting)
    return accepted


def _assert_all_free(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    assert stats["free_state_slots"] == stats["state_slots"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_dir, mode", CASES, indirect=["model_dir"])
def test_rollback_at_every_depth_matches_hf(model_dir, references, oracle_drafts, backend: str, mode: str) -> None:
    prompts, refs = references
    llm = LLM(model=str(model_dir), attention_backend=backend, speculative_config=NGRAM,
              **{"num_kv_blocks": 128, **MODES[mode]})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} differs in mode {mode}"
    assert set(oracle_drafts) == set(range(K + 1)), "not every rollback depth was verified"
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was not small enough to preempt"
    _assert_all_free(llm)


@functools.cache
def _cycle_references(model_dir: pathlib.Path) -> tuple[list[list[int]], list[list[int]]]:
    """Repeated cycles: n-gram drafts that a random model mostly rejects, so nearly every step rolls back."""
    p = sample_prompts(model_dir, 3, seed=3)
    prompts = [p[0][:3] * 12, p[1][:2] * 15, p[2]]
    return prompts, [hf_greedy(model_dir, q, MAX_TOKENS) for q in prompts]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ngram_drafts_mostly_rejected_match_hf(model_dir, backend: str) -> None:
    prompts, refs = _cycle_references(model_dir)
    llm = LLM(model=str(model_dir), attention_backend=backend, num_kv_blocks=128, speculative_config=NGRAM,
              max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    stats = llm.speculative_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]
    _assert_all_free(llm)


def test_triton_rollback_matches_hf(model_dir, references, oracle_drafts) -> None:
    """The full-attention layers through the Triton backend (under its interpreter on a CPU)."""
    device = pytest.importorskip("triton_interpret").backend_device()
    prompts, refs = references
    llm = LLM(model=str(model_dir), device=str(device), attention_backend="triton", num_kv_blocks=64,
              max_num_batched_tokens=24, dtype="float32", speculative_config=NGRAM)
    outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs[:2]
    assert set(oracle_drafts) == set(range(K + 1))
    _assert_all_free(llm)


def test_abort_mid_speculation_frees_slot_and_blocks(model_dir, references, oracle_drafts) -> None:
    prompts, _ = references
    llm = LLM(model=str(model_dir), num_kv_blocks=64, speculative_config=NGRAM)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    while len(oracle_drafts) < 3:
        engine.step()
    assert engine.get_request(ids[0]).state_slot is not None
    for request_id in ids:
        engine.abort_request(request_id)
    _assert_all_free(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_recurrence_is_plain_decode_bit_for_bit(tiny_model_factory, backend: str) -> None:
    """One linear layer over a draft of K tokens after a token, then the same rows decoded one step at
    a time: the same outputs and, after every position, the same conv and recurrent states, to the bit."""
    cfg = load_model_config(tiny_model_factory("qwen3_5"))
    layer = GatedDeltaNet(cfg, SINGLE)
    gen = torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.5
    shape, rows, context = cfg.linear_attention, 1 + K, 9
    mixed = torch.randn(rows, shape.conv_dim, generator=gen)
    g = -torch.rand(rows, shape.num_v_heads, generator=gen)
    beta = torch.rand(rows, shape.num_v_heads, generator=gen)
    conv = torch.randn(1, shape.conv_dim, shape.conv_kernel - 1, generator=gen)
    recurrent = torch.randn(1, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim, generator=gen)
    backend_ = select_backend(backend, torch.device("cpu"), torch.float32, cfg)

    def meta(q_len: int, draft_scratch: dict[int, int]):
        kv_len = context + q_len
        layout = BatchLayout(16, [0] * q_len, list(range(context, kv_len)), list(range(context, kv_len)), [0],
                             [q_len], [kv_len], [[0]], [0], draft_scratch)
        m = backend_.build_metadata(layout)
        m.linear_state = LinearStateBatch.build([0], [0], [q_len], [kv_len], torch.device("cpu"), torch.float32,
                                                draft_scratch)
        return m

    # the draft: slot 0, scratch slots 1..K (the state after positions 0..K-1), the last back in slot 0
    pools = tuple(torch.cat([state, torch.zeros(K, *state.shape[1:])]) for state in (conv, recurrent))
    verified = layer.recur(mixed, g, beta, pools, meta(rows, {0: 1}))
    states_after = [(pools[0][t + 1], pools[1][t + 1]) for t in range(K)] + [(pools[0][0], pools[1][0])]
    decode_pools = (conv.clone(), recurrent.clone())
    for t in range(rows):
        out = layer.recur(mixed[t:t + 1], g[t:t + 1], beta[t:t + 1], decode_pools, meta(1, {}))
        assert torch.equal(out[0], verified[t]), f"position {t}: output"
        assert torch.equal(decode_pools[0][0], states_after[t][0]), f"position {t}: conv state"
        assert torch.equal(decode_pools[1][0], states_after[t][1]), f"position {t}: recurrent state"
        context += 1


def test_hybrid_target_with_a_draft_model(tiny_model_factory) -> None:
    """A plain (full-attention) draft for a hybrid target; a hybrid draft is refused."""
    model_dir = tiny_model_factory("qwen3_5")
    draft_dir = tiny_model_factory("qwen3")
    prompts = sample_prompts(model_dir, 3, seed=4, max_len=40)
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    llm = LLM(model=str(model_dir), num_kv_blocks=64, speculative_config=spec, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    assert llm.speculative_stats()["spec_num_drafts"] > 0
    _assert_all_free(llm)
    assert llm.engine.scheduler.proposer.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="draft model .qwen3_5_text. has linear-attention layers"):
        LLM(model=str(draft_dir), num_kv_blocks=64, speculative_config={**spec, "model": str(model_dir)})


def test_draft_scratch_comes_out_of_the_budget(model_dir) -> None:
    """With --kv-cache-memory-gb, K scratch slots per draft a step may verify come first, then the state
    slots from half of the rest, then the KV pool."""
    from roseinfer.worker.model_runner import ModelRunner

    budget_gb = 0.0005
    llm = LLM(model=str(model_dir), kv_cache_memory_gb=budget_gb, max_num_seqs=64,
              speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine = llm.engine
    slot_bytes = ModelRunner.state_bytes_per_slot(engine.model_config, torch.float32)
    block_bytes = ModelRunner.kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32)
    stats = llm.kv_cache_stats()
    rest = int(budget_gb * 2**30) - 2 * K * slot_bytes
    assert stats["state_slots"] == rest // 2 // slot_bytes
    assert stats["total_blocks"] == (rest - stats["state_slots"] * slot_bytes) // block_bytes
    assert engine.runner.state_caches[0][1].shape[0] == stats["state_slots"] + 2 * K
