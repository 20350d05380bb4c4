"""Sliding-window attention and attention logit soft-capping (layers/attention.py PagedAttention), per
layer, in every backend; and the KV blocks given back once they fall outside every layer's window.

Whole models with windows: tiny_models' qwen2_sliding (one global layer, one sliding) is in ARCHS, so
every arch-parametrized test runs it; mistral_sliding (every layer slides) runs tests/test_correctness.py's
scheduling modes here.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.backends.base import Backend, BatchLayout
from roseinfer.backends.cpu import CPUBackend
from roseinfer.backends.torch_sdpa import TorchBackend
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.rotary import apply_rotary
from roseinfer.models.config import ModelConfig
from test_correctness import GREEDY as CORRECTNESS_GREEDY
from test_correctness import MODES as CORRECTNESS_MODES
from test_correctness import _prompts as correctness_prompts
from test_speculative import NGRAM
from test_speculative import _prompts as speculative_prompts
from tiny_models import SLIDING_WINDOW, hf_greedy, sample_prompts

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 4


def _backend_classes() -> dict[str, type[Backend]]:
    classes: dict[str, type[Backend]] = {"torch": TorchBackend}
    if CPUBackend.supports(CPU, torch.float32):
        classes["cpu"] = CPUBackend
    try:
        import triton_interpret
        from roseinfer.backends.triton import TritonBackend

        triton_interpret.patch_interpreter()
        if TritonBackend.supports(CPU, torch.float32):
            classes["triton"] = TritonBackend
    except ImportError:
        pass
    return classes


BACKENDS = _backend_classes()

# (rows this step, context once they are cached) per sequence
LAYOUTS = {
    "decodes": [(1, 30), (1, 5), (1, 17), (1, 1)],
    "whole_prompts": [(12, 12), (7, 7)],
    # a decode, a whole prompt, a later chunk, a short chunk (the CPU backend's decode rows), a tiny one
    "mixed": [(1, 30), (12, 12), (9, 40), (3, 20), (2, 2)],
}
# (sliding_window, logit_softcap): a window shorter than most contexts, a cap that bites, both, and
# a window of one token (each query sees itself only)
OPTIONS = [(6, None), (None, 5.0), (6, 5.0), (1, None)]


def _case(seed: int, shape: list[tuple[int, int]]):
    """A pool with each sequence's blocks scattered, this step's q/k/v and its BatchLayout."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // BLOCK_SIZE) for _, ctx in shape)
    num_blocks = len(shape) * max_blocks + 3
    caches = [torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2)]
    tables = torch.randperm(num_blocks, generator=g)[:len(shape) * max_blocks].view(len(shape), max_blocks).tolist()
    rows = sum(q for q, _ in shape)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g) * 3  # scores of several units: a cap of 5 bites
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    positions = [p for q_len, ctx in shape for p in range(ctx - q_len, ctx)]
    owners = [i for i, (q_len, _) in enumerate(shape) for _ in range(q_len)]
    slots = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in zip(owners, positions)]
    starts = [sum(q_len for q_len, _ in shape[:i]) for i in range(len(shape))]
    layout = BatchLayout(BLOCK_SIZE, [0] * rows, positions, slots, starts, [q_len for q_len, _ in shape],
                         [ctx for _, ctx in shape], tables)
    return q, k, v, caches, layout


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[torch.Tensor], layout: BatchLayout,
               layer: PagedAttention) -> torch.Tensor:
    """Each sequence's queries over its whole context, scores scaled, capped, masked to the window and
    softmaxed as transformers' eager attention does, in float64."""
    k_cache, v_cache = (c.clone() for c in caches)
    k_cache[layout.slot_mapping], v_cache[layout.slot_mapping] = k, v
    out = torch.empty(q.shape, dtype=torch.float64)
    for start, q_len, ctx, table in zip(layout.q_starts, layout.q_lens, layout.kv_lens, layout.block_tables):
        slots = [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(ctx)]
        keys, values = (c[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
                        for c in (k_cache, v_cache))  # [H, ctx, D]
        scores = q[start:start + q_len].double().transpose(0, 1) @ keys.transpose(1, 2) * layer.scale
        if layer.logit_softcap is not None:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        positions, key_positions = torch.arange(ctx - q_len, ctx).unsqueeze(1), torch.arange(ctx)
        visible = key_positions <= positions
        if layer.sliding_window is not None:
            visible &= positions - key_positions < layer.sliding_window
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + q_len] = (weights @ values).transpose(0, 1)
    return out.float()


@pytest.mark.parametrize("options", OPTIONS, ids=[f"window{w}-cap{c}" for w, c in OPTIONS])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_each_backend_attends_within_the_window_with_capped_scores(backend_name: str, layout_name: str,
                                                                   options: tuple[int | None, float | None]) -> None:
    window, cap = options
    q, k, v, caches, layout = _case(sum(map(ord, layout_name)), LAYOUTS[layout_name])
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window, logit_softcap=cap)
    expected = _reference(q, k, v, caches, layout, layer)
    plain = _reference(q, k, v, caches, layout, PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5))
    assert (expected - plain).abs().max() > 0.1, "the window or cap changes nothing here: the test would not see it"
    shape = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    meta = BACKENDS[backend_name](CPU, torch.float32, shape).build_metadata(layout)
    got = layer(q, k, v, [c.clone() for c in caches], meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")
@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_decode_splits_cover_only_the_window(num_splits: int) -> None:
    """Split-KV decode (several programs per sequence, merged after; the interpreter's one "SM" never
    chooses it): the splits share out the window's keys, and an empty split weighs nothing."""
    from roseinfer.backends.triton import kernels

    q, k, v, caches, layout = _case(11, [(1, 30), (1, 5), (1, 17), (1, 1)])
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=6, logit_softcap=5.0)
    k_cache, v_cache = (c.clone() for c in caches)
    kernels.store_kv(k, v, torch.tensor(layout.slot_mapping), k_cache, v_cache)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor(layout.block_tables),
                                         torch.tensor(layout.kv_lens), BLOCK_SIZE, layer.scale, num_splits=num_splits,
                                         sliding_window=6, logit_softcap=5.0)
    torch.testing.assert_close(got, _reference(q, k, v, caches, layout, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("options", OPTIONS[2:], ids=["window6-cap5", "window1"])
def test_the_cpu_fused_decode_windows_and_caps_as_the_layer_path(options: tuple[int | None, float | None]) -> None:
    """A decode step's qkv output goes through rotary, the KV write and attention in one C call
    (CPUMetadata.attend_qkv): the same numbers as rotating and attending one after another."""
    window, cap = options
    _, k, v, caches, layout = _case(5, LAYOUTS["decodes"])
    rows = k.shape[0]
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM) * 3
    rope = torch.polar(torch.ones(rows, 1, HEAD_DIM // 2), torch.randn(rows, 1, HEAD_DIM // 2))
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window, logit_softcap=cap)
    shape = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    meta = CPUBackend(CPU, torch.float32, shape).build_metadata(layout)
    assert meta.fused_decode
    qk = apply_rotary(qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM), rope)
    values = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
    expected = _reference(qk[:, :HEADS], qk[:, HEADS:], values, caches, layout, layer)
    got = layer.forward_qkv(qkv.clone(), rope, [c.clone() for c in caches], meta)
    torch.testing.assert_close(got, expected.flatten(1), rtol=1e-5, atol=1e-5)


def test_config_windows_follow_transformers() -> None:
    """Mistral's window goes to every layer, so its blocks can be given back; Qwen2's only under
    use_sliding_window and from max_window_layers on, so one global layer keeps every block."""
    base = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 128}
    mistral = ModelConfig.from_dict({"model_type": "mistral", **base, "sliding_window": 8})
    assert [mistral.layer_sliding_window(i) for i in range(3)] == [8, 8, 8] and mistral.kv_window == 8
    assert mistral.max_position_embeddings == 131072  # the real context, no longer capped at the window
    qwen = {"model_type": "qwen2", **base, "sliding_window": 8, "max_window_layers": 1}
    assert ModelConfig.from_dict(qwen).sliding_windows == ()  # use_sliding_window defaults to off
    hybrid = ModelConfig.from_dict({**qwen, "use_sliding_window": True})
    assert hybrid.sliding_windows == (None, 8, 8) and hybrid.kv_window is None
    assert ModelConfig.from_dict({"model_type": "llama", **base}).kv_window is None


def test_blocks_wholly_before_the_window_are_given_back_and_stay_findable() -> None:
    """Window 6, blocks of 4: once 13 tokens are computed the next query (position 13) sees 8..13, so
    blocks 0 and 1 (tokens 0..7) go back to the pool, indexed; a request with the same prompt later
    finds all three full blocks but takes only the one inside its window."""
    manager = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    first = Request("a", list(range(100, 113)), SamplingParams())
    assert manager.append_slots(first, 13)
    for computed, released in ((8, 0), (9, 1), (13, 2)):
        first.num_computed_tokens = computed
        manager.cache_full_blocks(first)
        manager.release_outside_window(first)
        assert first.num_released_blocks == released and manager.num_used_blocks == 4 - released
    assert first.block_table[:2] == [0, 0] and len(first.block_table) == 4
    manager.free(first)
    assert manager.num_used_blocks == 0 and manager.stats_dict()["evictable_blocks"] == 3
    second = Request("b", list(range(100, 113)) + [7], SamplingParams())
    assert manager.allocate_cached_prefix(second) == 12
    assert second.num_released_blocks == 1 and second.block_table[0] == 0 and manager.num_used_blocks == 2
    manager.free(second)
    assert manager.num_used_blocks == 0


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_a_prompt_many_windows_long_keeps_its_blocks_bounded_by_the_window(tiny_model_factory,
                                                                          backend_name: str) -> None:
    """A 200-token prompt (25 windows) prefilled in 16-token chunks, then 24 tokens: HF's greedy tokens,
    while the request never holds more blocks than its window and one step's chunk can touch, and
    nothing once it is done. Blocks given back stay indexed, so the same prompt again hits the prefix
    cache, which hands it only the blocks inside the window."""
    if backend_name not in BACKENDS:
        pytest.skip("the CPU kernels do not build here")
    model_dir = tiny_model_factory("mistral_sliding")
    prompt = sample_prompts(model_dir, 1, seed=21, max_len=200)[0]
    prompt = (prompt * 2)[:200]
    llm = LLM(model=str(model_dir), attention_backend=backend_name, block_size=BLOCK_SIZE, num_kv_blocks=80,
              max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.block_manager.sliding_window == SLIDING_WINDOW
    # the window's tokens before a step, that step's chunk, and a block either side of them
    bound = -(-(SLIDING_WINDOW - 1 + 16) // BLOCK_SIZE) + 2
    expected = hf_greedy(model_dir, prompt, GREEDY.max_tokens)
    for run in range(2):  # the second run's prompt is served from the prefix cache, but for its last block
        request_id = engine.add_request(prompt, GREEDY)
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.kv_cache_stats()["used_blocks"])
        assert peak <= bound < -(-len(prompt) // BLOCK_SIZE), f"run {run}"
        assert engine.get_generated_ids(request_id) == expected, f"run {run}"
        assert engine.kv_cache_stats()["used_blocks"] == 0
    assert engine.kv_cache_stats()["prefix_cache_hits"] >= len(prompt) - BLOCK_SIZE


@pytest.fixture(scope="module")
def every_layer_slides(tiny_model_factory):
    model_dir = tiny_model_factory("mistral_sliding")
    prompts = correctness_prompts(model_dir)
    return model_dir, prompts, [hf_greedy(model_dir, p, CORRECTNESS_GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("mode", [mode for mode in CORRECTNESS_MODES if mode != "preemption"])
def test_every_scheduling_mode_where_every_layer_slides(every_layer_slides, mode: str) -> None:
    """tests/test_correctness.py's modes on mistral_sliding (not in ARCHS: its preemption mode's pool
    no longer runs short once blocks go back; the preemption test below has its own), with blocks of
    4 so that they go back often: HF's tokens, prefix hits, and every block free after."""
    model_dir, prompts, refs = every_layer_slides
    llm = LLM(model=str(model_dir), **{"num_kv_blocks": 128, "block_size": BLOCK_SIZE, **CORRECTNESS_MODES[mode]})
    outs = llm.generate(prompts[:6], CORRECTNESS_GREEDY, use_tqdm=False)
    outs += llm.generate(prompts[6:], CORRECTNESS_GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    if llm.engine.config.enable_prefix_caching:
        assert stats["prefix_cache_hits"] > 0


def test_ngram_speculation_while_blocks_go_back(tiny_model_factory) -> None:
    """Drafts verified across the window's edge while the window's blocks go back (a rejected draft's
    own blocks go back through BlockManager.shrink): HF's tokens, some drafts accepted, the pool whole."""
    model_dir = tiny_model_factory("mistral_sliding")
    prompts = speculative_prompts(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = LLM(model=str(model_dir), num_kv_blocks=128, block_size=BLOCK_SIZE, speculative_config=NGRAM)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, params.max_tokens) for p in prompts]
    assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"
    assert llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.parametrize("arch", ["mistral_sliding", "qwen2_sliding"])
def test_preemption_and_mixed_batches_with_blocks_given_back(tiny_model_factory, arch: str) -> None:
    """Eight prompts of up to four windows in a pool of 12 blocks: preemptions, chunks beside decodes,
    and (for mistral_sliding, where every layer slides) blocks given back, with HF's tokens throughout.
    qwen2_sliding has a global layer: nothing may be given back."""
    model_dir = tiny_model_factory(arch)
    prompts = sample_prompts(model_dir, 8, seed=9, max_len=30)
    llm = LLM(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_batched_tokens=16)
    assert llm.engine.block_manager.sliding_window == (SLIDING_WINDOW if arch == "mistral_sliding" else None)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, params.max_tokens) for p in prompts]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was not small enough to preempt"
    assert llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")
@pytest.mark.parametrize("arch", ["mistral_sliding", "qwen2_sliding"])
def test_triton_greedy_matches_hf_through_chunks_and_prefix_hits(tiny_model_factory, arch: str) -> None:
    import triton_interpret

    model_dir = tiny_model_factory(arch)
    prompts = sample_prompts(model_dir, 3, seed=5, max_len=60)
    prompts.append(prompts[1][:20] + [7, 8, 9])  # shares full blocks with prompts[1]
    llm = LLM(model=str(model_dir), device=str(triton_interpret.device()), attention_backend="triton",
              num_kv_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=8, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts[:3], greedy, use_tqdm=False) + llm.generate(prompts[3:], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in prompts]
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0 and stats["prefix_cache_hits"] > 0
