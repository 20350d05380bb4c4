"""gpt-oss (models/gpt_oss.py): HF's greedy tokens in every scheduling mode, every KV block free
after; the backends without attention sinks refuse it (auto passes them over); the MoE block,
sinks and clamp against transformers' modules; MXFP4 experts dequantized as transformers does."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from roseinfer import LLM
from roseinfer.layers.mxfp4 import dequantize_mxfp4, dequantized_mxfp4
from roseinfer.models.config import ModelConfig
from roseinfer.models.gpt_oss import GptOssMoe, select_top_logits
from roseinfer.models.registry import build_model
from test_correctness import GREEDY, MAX_TOKENS
from test_correctness import _prompts as correctness_prompts
from test_moe import MODES
from test_speculative import _prompts as speculative_prompts
from tiny_models import hf_greedy, load_hf_model

ARCH = "gpt_oss"
# the backends whose attention has no sinks: refused by name, so they are not modes here
SINKLESS = ("cpu", "triton")


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory):
    model_dir = tiny_model_factory(ARCH)
    prompts = {"plain": correctness_prompts(model_dir), "speculative": speculative_prompts(model_dir)}
    refs = {kind: [hf_greedy(model_dir, p, MAX_TOKENS) for p in ps] for kind, ps in prompts.items()}
    return model_dir, prompts, refs


@pytest.mark.parametrize("mode", [m for m in MODES if MODES[m].get("attention_backend") not in SINKLESS])
def test_greedy_matches_hf_in_every_mode(gpt_oss, mode: str) -> None:
    model_dir, prompts, refs = gpt_oss
    kind = "speculative" if "speculative_config" in MODES[mode] else "plain"
    llm = LLM(model=str(model_dir), **{"num_kv_blocks": 128, **MODES[mode]})
    assert llm.engine.backend.name == "torch"  # auto passes over the backends without sinks
    outs = llm.generate(prompts[kind][:6], GREEDY, use_tqdm=False)
    outs += llm.generate(prompts[kind][6:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs[kind]
    stats = llm.kv_cache_stats()
    assert stats["used_blocks"] == 0
    if mode == "preemption":
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "pool was not small enough to preempt"
    if kind == "speculative":
        assert llm.speculative_stats()["spec_num_accepted_tokens"] > 0
    elif llm.engine.config.enable_prefix_caching:
        assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("backend", SINKLESS)
def test_backends_without_sinks_refuse_it_by_name(tiny_model_factory, backend: str) -> None:
    from roseinfer.backends import select_backend

    cfg = ModelConfig.from_dict(load_hf_model(tiny_model_factory(ARCH)).config.to_dict())
    with pytest.raises(ValueError, match="attention sinks"):
        select_backend(backend, torch.device("cpu"), torch.float32, cfg)


def _hf_model_and_ours(tiny_model_factory):
    model_dir = tiny_model_factory(ARCH)
    hf = load_hf_model(model_dir)
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    ours = build_model(cfg)
    ours.load_weights(load_file(str(model_dir / "model.safetensors")).items())
    return hf, ours, cfg


@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_the_moe_block_equals_transformers(tiny_model_factory, routing: str) -> None:
    """Random tokens, and every token leaning towards expert 5: the router's picks and weights equal
    transformers', the block's output within fp32 rounding; the clamp bites on these rows."""
    hf, ours, cfg = _hf_model_and_ours(tiny_model_factory)
    block, mine = hf.model.layers[1].mlp, ours.model.layers[1].mlp
    assert isinstance(mine, GptOssMoe)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if routing == "one_expert":
            x += 4 * torch.nn.functional.normalize(block.router.weight[5], dim=0)
        _, hf_weights, hf_experts = block.router(x)
        weights, experts = select_top_logits(mine.router.forward(x), cfg.moe.top_k)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        if routing == "one_expert":
            assert (experts == 5).any(dim=1).all()
        torch.testing.assert_close(mine.forward(x), block(x.unsqueeze(0))[0].squeeze(0), rtol=1e-5, atol=1e-5)
        gate_up = x @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > cfg.clamped_swiglu.limit).any()


def test_sinks_bite_in_the_tiny_model(tiny_model_factory) -> None:
    """Sinks far below every score leave plain softmax attention, which changes the logits: the
    greedy tests above see them."""
    hf, _, _ = _hf_model_and_ours(tiny_model_factory)
    ids = torch.arange(40).unsqueeze(0)
    sinks = [layer.self_attn.sinks for layer in hf.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        with_sinks = hf(ids).logits
        try:
            for s in sinks:
                s.fill_(-1e4)
            without = hf(ids).logits
        finally:
            for s, old in zip(sinks, saved):
                s.copy_(old)
    assert (with_sinks - without).abs().max() > 1e-3


def test_mxfp4_dequantization_equals_transformers() -> None:
    """Every byte and a spread of exponents: the values transformers' MXFP4 integration gives, bit
    for bit ([E, out, in], before its transpose)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles through all 16 codes
    scales = torch.randint(110, 140, (3, 8, 2), dtype=torch.uint8, generator=gen)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_tensors(tiny_model_factory) -> None:
    """The tiny checkpoint's experts replaced by MXFP4 blocks and scales (scales before blocks, as a
    file may order them) load into the same weights as the transformers-dequantized tensors do."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model_dir = tiny_model_factory(ARCH)
    cfg = ModelConfig.from_dict(load_hf_model(model_dir).config.to_dict())
    gen = torch.Generator().manual_seed(1)
    packed, dense = {}, {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = tensor.shape[0], tensor.shape[2], tensor.shape[1]
            blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(120, 130, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
            packed[name + "_scales"], packed[name + "_blocks"] = scales, blocks
            dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = dense[name] = tensor
    assert list(dequantized_mxfp4(packed.items()))  # pairs found, nothing left waiting
    from_packed, from_dense = build_model(cfg), build_model(cfg)
    from_packed.load_weights(packed.items())
    from_dense.load_weights(dense.items())
    for (name, a), (_, b) in zip(from_packed.state_dict().items(), from_dense.state_dict().items()):
        assert torch.equal(a, b), name


def test_references_are_not_degenerate(tiny_model_factory) -> None:
    from test_tiny_models import test_reference_not_degenerate

    test_reference_not_degenerate(tiny_model_factory(ARCH), hf_greedy)
