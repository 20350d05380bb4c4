"""Mixtures of experts (models/moe.py, models/moe_llama.py): Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE
give HF's greedy tokens in every scheduling mode and on every backend (triton under the interpreter),
and leave every KV block free; the router and the grouped expert compute against transformers'
modules, with ties and with every token on one expert."""
from __future__ import annotations

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.models.config import ModelConfig
from roseinfer.models.moe import SparseMoeBlock, select_experts
from test_correctness import MAX_TOKENS
from test_correctness import _prompts as correctness_prompts
from test_sliding_window import BACKENDS
from test_speculative import NGRAM
from test_speculative import _prompts as speculative_prompts
from tiny_models import MOE_ARCHS, hf_greedy

# name -> engine options; every mode must leave the outputs HF's
MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 10},
    "decode_first": {"decode_first": True, "max_num_batched_tokens": 16},
    "no_prefix_cache_no_chunking": {"enable_prefix_caching": False, "enable_chunked_prefill": False},
    "torch_backend": {"attention_backend": "torch", "max_num_batched_tokens": 16},
    "triton_backend": {"attention_backend": "triton", "max_num_batched_tokens": 16},
    "ngram_speculation": {"speculative_config": NGRAM, "max_num_batched_tokens": 16},
}
# Triton's kernels run in its interpreter on a CPU, where a token costs ~100x a CPU-backend one: that
# mode makes the references' first 8 tokens (greedy, no EOS), as tests/test_triton_backend.py does. Its
# decodes still cross block boundaries and read two KV tiles (prompts of 25 to 100 tokens).
TRITON_TOKENS = 8


def model_references(model_dir):
    """(the folder, its prompts for plain and speculative runs, HF's greedy tokens for each)."""
    prompts = {"plain": correctness_prompts(model_dir), "speculative": speculative_prompts(model_dir)}
    refs = {kind: [hf_greedy(model_dir, p, MAX_TOKENS) for p in ps] for kind, ps in prompts.items()}
    return model_dir, prompts, refs


# gpt-oss (tests/test_gpt_oss.py has its sinks, router and MXFP4) runs the same modes here
@pytest.fixture(scope="module", params=MOE_ARCHS + ["gpt_oss"])
def moe_model(request, tiny_model_factory):
    return model_references(tiny_model_factory(request.param))


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf_in_every_mode(moe_model, mode: str) -> None:
    backend = MODES[mode].get("attention_backend")
    if backend is not None and backend not in BACKENDS:
        pytest.skip(f"the {backend} backend does not run here")
    model_dir, prompts, refs = moe_model
    kind = "speculative" if "speculative_config" in MODES[mode] else "plain"
    llm = LLM(model=str(model_dir), **{"num_kv_blocks": 128, **MODES[mode]})
    tokens = TRITON_TOKENS if backend == "triton" else MAX_TOKENS
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    # two calls, so the second's shared prefixes and exact repeat find the first's cached blocks
    outs = llm.generate(prompts[kind][:6], greedy, use_tqdm=False)
    outs += llm.generate(prompts[kind][6:], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [ref[:tokens] for ref in refs[kind]]
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"
    if kind == "speculative":
        assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0
    elif llm.engine.config.enable_prefix_caching:
        assert stats["prefix_cache_hits"] > 0


def _tiny_layout(arch: str):
    from tiny_models import _config

    hf = _config(arch)
    return hf, ModelConfig.from_dict(hf.to_dict())


def test_layers_are_sparse_or_dense_as_transformers_builds_them(tiny_model_factory) -> None:
    """Qwen3-MoE's mlp_only_layers and Qwen2-MoE's decoder_sparse_step leave layers dense; OLMoE's
    q/k norms span every head."""
    from transformers import AutoModelForCausalLM

    for arch in MOE_ARCHS:
        hf, cfg = _tiny_layout(arch)
        model = AutoModelForCausalLM.from_config(hf)
        sparse = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        assert cfg.moe.sparse_layers == sparse and 0 < len(sparse), arch
        assert cfg.moe.num_experts == 8 and cfg.moe.top_k == hf.num_experts_per_tok
        assert cfg.qk_norm_across_heads == (arch == "olmoe") and cfg.clip_qkv == getattr(hf, "clip_qkv", None)


def _hf_block(arch: str, seed: int):
    """transformers' MoE block of a tiny config with random weights, and ours holding the same. Its
    experts run the modeling file's loop ("eager"), not torch's grouped_mm, which rounds otherwise."""
    from transformers import AutoModelForCausalLM

    hf_config, cfg = _tiny_layout(arch)
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(hf_config, experts_implementation="eager")
    block = hf_model.model.layers[cfg.moe.sparse_layers[0]].mlp
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    ours = SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.hidden_act)
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ours.experts.down_proj.copy_(block.experts.down_proj)
        if ours.shared_expert is not None:
            shared = block.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return block.eval(), ours, cfg


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("routing", ["random", "one_expert", "ties"])
def test_the_block_equals_transformers_bit_for_bit(arch: str, routing: str) -> None:
    """Random tokens; every token's router favouring expert 5; a router whose logits tie for every
    expert (all weights equal): topk picks and weights as transformers', outputs equal."""
    block, ours, cfg = _hf_block(arch, seed=3)
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        if routing == "one_expert":  # every token leans along one direction, which expert 5's row reads
            direction = torch.nn.functional.normalize(torch.randn(cfg.hidden_size), dim=0)
            x += 4 * direction
            block.gate.weight[5] = 20 * direction
        elif routing == "ties":
            block.gate.weight.fill_(0.01)
        ours.gate.weight.copy_(block.gate.weight)
        _, hf_weights, hf_experts = block.gate(x)
        weights, experts = select_experts(ours.gate.forward(x), cfg.moe.top_k, cfg.moe.norm_topk_prob)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        if routing == "one_expert":
            assert (experts == 5).any(dim=1).all()
        if routing == "ties":
            assert torch.equal(weights, torch.full_like(weights, weights[0, 0].item()))
        assert torch.equal(ours.forward(x), block(x.unsqueeze(0)).squeeze(0))


def test_grouped_expert_compute_equals_a_per_token_reference() -> None:
    """Each token's experts one at a time, in float64: the grouped compute's sums (top-3, so their
    order rounds) agree; tokens with no pairs for an expert leave it unread."""
    block, ours, cfg = _hf_block("olmoe", seed=5)
    x = torch.randn(50, cfg.hidden_size)
    with torch.no_grad():
        weights, experts = select_experts(ours.gate.forward(x), cfg.moe.top_k, cfg.moe.norm_topk_prob)
        got = ours.experts.forward(x, weights, experts)
        expected = torch.zeros(x.shape, dtype=torch.float64)
        gate_up, down = ours.experts.gate_up_proj.double(), ours.experts.down_proj.double()
        for t in range(x.shape[0]):
            for w, e in zip(weights[t].tolist(), experts[t].tolist()):
                gate, up = (gate_up[e] @ x[t].double()).chunk(2)
                expected[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    assert experts.unique().numel() < cfg.moe.num_experts or x.shape[0] > 8


def test_clip_qkv_bites_in_the_tiny_olmoe(tiny_model_factory) -> None:
    """The tiny OLMoE's clip changes its outputs, so the greedy tests above see it."""
    from tiny_models import load_hf_model

    model = load_hf_model(tiny_model_factory("olmoe"))
    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        clipped = model(ids).logits
        model.config.clip_qkv = None
        try:
            unclipped = model(ids).logits
        finally:
            model.config.clip_qkv = 1.5
    assert (clipped - unclipped).abs().max() > 1e-3


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_references_are_not_degenerate(tiny_model_factory, arch: str) -> None:
    """tests/test_tiny_models.py's check for ARCHS (varied continuations, top-2 gaps far from ties)
    on the mixtures of experts, whose routing would flip on a near-tie as well."""
    from test_tiny_models import test_reference_not_degenerate

    test_reference_not_degenerate(tiny_model_factory(arch), hf_greedy)
