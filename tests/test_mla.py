"""DeepSeek-V2 / V3: multi-head latent attention (layers/mla.py) and the DeepSeek mixture of experts
(layers/deepseek_moe.py), against transformers in fp32: greedy tokens in every scheduling mode and
backend, n-gram speculation, the KV pool's one latent row per token, and the routing against a
per-token reference, ties and one-expert batches included. tiny_models' deepseek archs are in
EXTRA_ARCHS (built here, not by every arch-parametrized test)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.backends.base import BatchLayout
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.deepseek_layouts import DeepseekRouting
from roseinfer.distributed.parallel import SINGLE
from roseinfer.layers.deepseek_moe import DeepseekRouter, route
from roseinfer.models.config import ModelConfig
from roseinfer.models.moe import StackedExperts
from roseinfer.worker.model_runner import ModelRunner
from roseinfer.worker.sharding import check_tensor_parallel
from test_correctness import GREEDY, MODES
from test_correctness import _prompts as correctness_prompts
from test_speculative import NGRAM
from test_sliding_window import BACKENDS
from test_speculative import _prompts as speculative_prompts
from tiny_models import hf_greedy, load_hf_model, sample_prompts

DEEPSEEK_ARCHS = ["deepseek_v2_lite", "deepseek_v3"]


@pytest.fixture(scope="module", params=DEEPSEEK_ARCHS)
def deepseek(request: pytest.FixtureRequest, tiny_model_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    model_dir = tiny_model_factory(request.param)
    prompts = correctness_prompts(model_dir)
    refs = [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]
    assert any(len(set(r)) > 3 for r in refs), "degenerate reference"
    return model_dir, prompts, refs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf_in_every_scheduling_mode(deepseek, mode: str) -> None:
    """Mixed batches, chunked prefill, preemption, prefix caching, each backend that runs here
    (the CPU backend by default where its kernels build, the torch reference in torch_backend)."""
    model_dir, prompts, refs = deepseek
    llm = LLM(model=str(model_dir), **{"num_kv_blocks": 128, **MODES[mode]})
    outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False) + llm.generate(prompts[6:], GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs in mode {mode}"
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"
    if llm.engine.config.enable_prefix_caching:
        assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_ngram_speculation_matches_hf(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = speculative_prompts(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=str(model_dir), num_kv_blocks=128, speculative_config=NGRAM)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, params.max_tokens) for p in prompts]
    assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"
    assert llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.triton
@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_triton_greedy_matches_hf_through_chunks_and_prefix_hits(tiny_model_factory, arch: str) -> None:
    """The Triton kernels, unchanged, attend MLA as multi-query attention over the latent rows."""
    pytest.importorskip("triton")
    import triton_interpret

    triton_interpret.patch_interpreter()
    model_dir = tiny_model_factory(arch)
    prompts = sample_prompts(model_dir, 3, seed=5, max_len=60)
    prompts.append(prompts[1][:40] + [7, 8, 9])  # shares full blocks with prompts[1]
    llm = LLM(model=str(model_dir), device=str(triton_interpret.device()), attention_backend="triton",
              num_kv_blocks=64, block_size=16, max_num_batched_tokens=8, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts[:3], greedy, use_tqdm=False) + llm.generate(prompts[3:], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in prompts]
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0 and stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_the_pool_holds_one_latent_and_rope_row_per_token(tiny_model_factory, arch: str) -> None:
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values, no per-head K, no V."""
    model_dir = tiny_model_factory(arch)
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    row = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert ModelRunner.kv_bytes_per_block(cfg, 1, torch.float32) == raw["num_hidden_layers"] * row * 4
    full_kv = 2 * raw["num_attention_heads"] * (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"])
    assert row * 4 < full_kv  # what transformers' expanded K and V would take, per token and layer
    runner = LLM(model=str(model_dir), num_kv_blocks=8, block_size=16).engine.executor.driver.runner
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache.data_ptr() == v_cache.data_ptr() and k_cache.shape == (8 * 16, 1, row)


def test_rope_in_halves_checkpoint_matches_hf(tiny_model_factory, tmp_path: Path) -> None:
    """V3 with rope_interleave false rotates x[i] with x[i + d/2]: its rope rows are reordered at load."""
    source = tiny_model_factory("deepseek_v3")
    model_dir = tmp_path / "halves"
    shutil.copytree(source, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "rope_interleave": False}))
    prompts = sample_prompts(model_dir, 3, seed=7)
    refs = [hf_greedy(model_dir, p, 12) for p in prompts]
    assert refs != [hf_greedy(source, p, 12) for p in prompts], "the layout changes nothing: the test would not see it"
    outs = LLM(model=str(model_dir), num_kv_blocks=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs


def test_uneven_tensor_parallel_and_fp8_checkpoints_are_refused_with_the_reason(tiny_model_factory) -> None:
    raw = json.loads((tiny_model_factory("deepseek_v3") / "config.json").read_text())
    check_tensor_parallel(ModelConfig.from_dict(raw), 2)
    with pytest.raises(ValueError, match="expert width"):
        check_tensor_parallel(ModelConfig.from_dict({**raw, "moe_intermediate_size": 30}), 4)
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="fp8 block-quantized"):
        ModelConfig.from_dict({**raw, "quantization_config": fp8})


# --------------------------------------------------------------------------- routing

V2_GREEDY = DeepseekRouting(8, 2, "softmax", 1, 1, "max", False, 1.0)
V2_GROUPED = DeepseekRouting(8, 3, "softmax", 4, 2, "max", False, 1.5)
V3 = DeepseekRouting(8, 3, "sigmoid", 4, 2, "top2", True, 2.5)


def _reference_route(hidden: torch.Tensor, router: DeepseekRouter) -> list[list[tuple[int, float]]]:
    """Per token, in plain Python: each (expert, weight) chosen, in order; ties to the lower index."""
    r = router.routing
    chosen = []
    for logits in (hidden.double() @ router.weight.double().T).tolist():
        if r.scoring == "softmax":
            scores = torch.tensor(logits).softmax(0).tolist()
        else:
            scores = torch.tensor(logits).sigmoid().tolist()
        bias = router.e_score_correction_bias.tolist() if router.e_score_correction_bias is not None else [0.0] * 8
        choice = [s + b for s, b in zip(scores, bias)]
        size = r.num_experts // r.num_groups
        groups = [choice[g * size:(g + 1) * size] for g in range(r.num_groups)]
        group_scores = [max(g) if r.group_by == "max" else sum(sorted(g)[-2:]) for g in groups]
        kept = sorted(range(r.num_groups), key=lambda g: (-group_scores[g], g))[:r.top_groups]
        candidates = [e for e in range(r.num_experts) if e // size in kept]
        experts = sorted(candidates, key=lambda e: (-choice[e], e))[:r.top_k]
        weights = [scores[e] for e in experts]
        if r.normalise:
            weights = [w / sum(weights) for w in weights]
        chosen.append([(e, w * r.scaling_factor) for e, w in zip(experts, weights)])
    return chosen


def _router(routing: DeepseekRouting, seed: int) -> DeepseekRouter:
    router = DeepseekRouter(16, routing)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(routing.num_experts, 16, generator=g))
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.copy_(torch.randn(routing.num_experts, generator=g) * 0.3)
    return router


def _assert_routes_as_reference(hidden: torch.Tensor, router: DeepseekRouter) -> None:
    weights, ids = route(hidden, router)
    for token, expected in enumerate(_reference_route(hidden, router)):
        assert ids[token].tolist() == [e for e, _ in expected], f"token {token}"
        torch.testing.assert_close(weights[token], torch.tensor([w for _, w in expected]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routing", [V2_GREEDY, V2_GROUPED, V3], ids=["v2_greedy", "v2_grouped", "v3"])
def test_route_matches_a_per_token_reference(routing: DeepseekRouting) -> None:
    hidden = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    _assert_routes_as_reference(hidden, _router(routing, 2))


@pytest.mark.parametrize("routing", [V2_GREEDY, V2_GROUPED, V3], ids=["v2_greedy", "v2_grouped", "v3"])
def test_route_breaks_ties_toward_the_lower_expert(routing: DeepseekRouting) -> None:
    """Router rows repeated: experts 0-3 score alike, as do 4-7, so every choice is a tie."""
    router = _router(routing, 3)
    with torch.no_grad():
        router.weight[1:4] = router.weight[0]
        router.weight[5:8] = router.weight[4]
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.zero_()
    hidden = torch.randn(16, 16, generator=torch.Generator().manual_seed(4))
    _assert_routes_as_reference(hidden, router)


@pytest.mark.parametrize("routing", [V2_GREEDY, V3], ids=["v2_greedy", "v3"])
def test_route_matches_transformers_routers(routing: DeepseekRouting) -> None:
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    common = dict(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=routing.top_k,
                  routed_scaling_factor=routing.scaling_factor)
    if routing.scoring == "softmax":
        hf = DeepseekV2TopkRouter(DeepseekV2Config(**common, topk_method="greedy"))
    else:
        hf = DeepseekV3TopkRouter(DeepseekV3Config(**common, n_group=4, topk_group=2, norm_topk_prob=True))
    ours = _router(routing, 5)
    with torch.no_grad():
        hf.weight.copy_(ours.weight)
        if ours.e_score_correction_bias is not None:
            hf.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    hidden = torch.randn(32, 16, generator=torch.Generator().manual_seed(6))
    _, hf_weights, hf_ids = hf(hidden)
    weights, ids = route(hidden, ours)
    order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)  # topk(sorted=False): compare as sets
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


def _experts(num: int) -> StackedExperts:
    torch.manual_seed(8)
    experts = StackedExperts(num, 16, 8, "silu", SINGLE)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return experts


@pytest.mark.parametrize("case", ["spread", "one_expert"])
def test_experts_match_a_per_token_reference(case: str) -> None:
    """Every token's weighted sum over its experts, token by token; and a batch routed wholly to
    one expert (as its top choice and as its second)."""
    experts = _experts(4)
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(10)
    if case == "spread":
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    else:
        ids = torch.tensor([[2, 0]] * 6 + [[1, 2]] * 6)
    weights = torch.rand(12, 2, generator=g)
    out = experts.forward(hidden, weights, ids)
    for token in range(12):
        expected = sum(weights[token, k] * experts.expert_mlp(int(ids[token, k]), hidden[token:token + 1])[0]
                       for k in range(2))
        torch.testing.assert_close(out[token], expected, rtol=1e-5, atol=1e-6)


def test_moe_layer_matches_transformers(tiny_model_factory) -> None:
    """The V3 MoE block (routed + shared experts) of the tiny checkpoint on random rows, as
    transformers' DeepseekV3MoE computes them."""
    model_dir = tiny_model_factory("deepseek_v3")
    llm = LLM(model=str(model_dir), num_kv_blocks=8, attention_backend="torch")
    ours = llm.engine.executor.driver.model.model.layers[1].mlp
    theirs = load_hf_model(model_dir).model.layers[1].mlp
    hidden = torch.randn(20, 64, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = theirs(hidden.unsqueeze(0))[0]
        torch.testing.assert_close(ours.forward(hidden, SimpleNamespace(mlp_chunk_rows=None)), expected,
                                   rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- DeepSeek's real row width

@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_each_backend_attends_deepseek_wide_latent_rows(backend_name: str) -> None:
    """DeepSeek-V2/V3's row (512 latent + 64 rope) under 16 query heads, keys and values the same
    cached rows, decodes beside prompt chunks: every backend's paged attention as a float64 reference."""
    heads, width, block_size = 16, 512 + 64, 16
    shape = [(1, 40), (1, 7), (9, 30), (12, 12)]  # (rows this step, context once cached) per sequence
    g = torch.Generator().manual_seed(12)
    tables = torch.randperm(12, generator=g)[:len(shape) * 3].view(len(shape), 3).tolist()
    cache = torch.randn(12 * block_size, 1, width, generator=g)
    rows = sum(q_len for q_len, _ in shape)
    q, row = torch.randn(rows, heads, width, generator=g), torch.randn(rows, 1, width, generator=g)
    positions = [p for q_len, ctx in shape for p in range(ctx - q_len, ctx)]
    owners = [i for i, (q_len, _) in enumerate(shape) for _ in range(q_len)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in zip(owners, positions)]
    starts = [sum(q_len for q_len, _ in shape[:i]) for i in range(len(shape))]
    layout = BatchLayout(block_size, [0] * rows, positions, slots, starts, [q_len for q_len, _ in shape],
                         [ctx for _, ctx in shape], tables)
    layer = PagedAttention(heads, 1, width, width ** -0.5)
    expected_cache = cache.clone()
    expected_cache[slots] = row
    expected = torch.empty(rows, heads, width, dtype=torch.float64)
    for start, (q_len, ctx), table in zip(starts, shape, tables):
        keys = expected_cache[[table[t // block_size] * block_size + t % block_size for t in range(ctx)], 0].double()
        scores = q[start:start + q_len].double() @ keys.T * layer.scale  # [q_len, H, ctx]
        visible = torch.arange(ctx) <= torch.arange(ctx - q_len, ctx).unsqueeze(1)
        weights = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
        expected[start:start + q_len] = weights @ keys
    pool_shape = SimpleNamespace(num_heads=heads, num_kv_heads=1, head_dim=width)
    meta = BACKENDS[backend_name](torch.device("cpu"), torch.float32, pool_shape).build_metadata(layout)
    pool = cache.clone()
    got = layer(q, row, row, (pool, pool), meta)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_cache)
