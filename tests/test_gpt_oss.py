"""gpt-oss (models/gpt_oss.py): HF's greedy tokens on two tensor-parallel ranks (every scheduling
mode and backend: tests/test_moe.py, which runs gpt-oss with the other mixtures);
attention sinks in each backend's attention against a float64 reference; the MoE block, sinks and
clamp against transformers' modules; MXFP4 experts dequantized as transformers does."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from roseinfer import LLM
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.mxfp4 import dequantize_mxfp4, dequantized_mxfp4
from roseinfer.layers.rotary import apply_rotary
from roseinfer.models.config import ModelConfig
from roseinfer.models.gpt_oss import GptOssMoe, select_top_logits
from roseinfer.models.registry import build_model
from test_correctness import GREEDY
from test_moe import model_references
from test_sliding_window import BACKENDS, BLOCK_SIZE, CPU, HEAD_DIM, HEADS, KV_HEADS, LAYOUTS, _case
from tiny_models import hf_greedy, load_hf_model

ARCH = "gpt_oss"


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory):
    return model_references(tiny_model_factory(ARCH))


def _sink_reference(q, k, v, caches, layout, layer):
    """test_sliding_window's float64 reference with each head's sink as one more score column."""
    k_cache, v_cache = (c.clone() for c in caches)
    k_cache[layout.slot_mapping], v_cache[layout.slot_mapping] = k, v
    heads, kv_heads = layer.num_heads, layer.num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for start, q_len, ctx, table in zip(layout.q_starts, layout.q_lens, layout.kv_lens, layout.block_tables):
        slots = [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(ctx)]
        keys, values = (c[slots].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
                        for c in (k_cache, v_cache))
        scores = q[start:start + q_len].double().transpose(0, 1) @ keys.transpose(1, 2) * layer.scale
        positions, key_positions = torch.arange(ctx - q_len, ctx).unsqueeze(1), torch.arange(ctx)
        visible = key_positions <= positions
        if layer.sliding_window is not None:
            visible &= positions - key_positions < layer.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = layer.sinks.double().view(heads, 1, 1).expand(heads, q_len, 1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out[start:start + q_len] = (weights @ values).transpose(0, 1)
    return out.float()


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_each_backend_with_sinks_attends_as_the_reference(backend_name: str, layout_name: str,
                                                          window: int | None) -> None:
    """Decodes, whole prompts and mixed steps (the CPU backend's C decode and prefill kernels)."""
    q, k, v, caches, layout = _case(sum(map(ord, layout_name)), LAYOUTS[layout_name])
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window, sinks=sinks)
    expected = _sink_reference(q, k, v, caches, layout, layer)
    plain = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window,
                           sinks=torch.full((HEADS,), -1e4))
    assert (expected - _sink_reference(q, k, v, caches, layout, plain)).abs().max() > 0.1
    shape = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    meta = BACKENDS[backend_name](CPU, torch.float32, shape).build_metadata(layout)
    got = layer(q, k, v, [c.clone() for c in caches], meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_decode_counts_each_sink_once(num_splits: int, window: int | None) -> None:
    """Split-KV decode (which the interpreter's one "SM" never chooses): the first split starts from
    the sink, the merge weighs it once; contexts of 1 and 5 tokens leave splits empty."""
    from roseinfer.backends.triton import kernels

    q, k, v, caches, layout = _case(11, LAYOUTS["decodes"])
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window,
                           sinks=torch.tensor([2.0, -1.0, 0.5, 4.0]))
    k_cache, v_cache = (c.clone() for c in caches)
    kernels.store_kv(k, v, torch.tensor(layout.slot_mapping), k_cache, v_cache)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor(layout.block_tables),
                                         torch.tensor(layout.kv_lens), BLOCK_SIZE, layer.scale, num_splits=num_splits,
                                         sliding_window=window, sinks=layer.sinks)
    torch.testing.assert_close(got, _sink_reference(q, k, v, caches, layout, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU kernels do not build here")
def test_the_cpu_fused_decode_applies_the_sinks() -> None:
    """A decode step's rotary, KV write and attention in one C call, sinks included."""
    _, k, v, caches, layout = _case(5, LAYOUTS["decodes"])
    rows = k.shape[0]
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM) * 3
    rope = torch.polar(torch.ones(rows, 1, HEAD_DIM // 2), torch.randn(rows, 1, HEAD_DIM // 2))
    layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sinks=torch.tensor([2.0, -1.0, 0.5, 4.0]))
    shape = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    meta = BACKENDS["cpu"](CPU, torch.float32, shape).build_metadata(layout)
    assert meta.fused_decode
    qk = apply_rotary(qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM), rope)
    values = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
    expected = _sink_reference(qk[:, :HEADS], qk[:, HEADS:], values, caches, layout, layer)
    got = layer.forward_qkv(qkv.clone(), rope, [c.clone() for c in caches], meta)
    torch.testing.assert_close(got, expected.flatten(1), rtol=1e-5, atol=1e-5)


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


def test_greedy_matches_hf_on_two_ranks(gpt_oss) -> None:
    """Chunked prefill, prefix caching and preemption over two ranks, each with half of every head's
    sinks, biases and every expert's width (down's bias on rank 0 alone): HF's tokens, every block free."""
    model_dir, prompts, refs = gpt_oss
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, num_kv_blocks=10, max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts["plain"][:6], GREEDY, use_tqdm=False)
        outs += llm.generate(prompts["plain"][6:], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == refs["plain"]
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert llm.kv_cache_stats()["used_blocks"] == 0
        attention = llm.engine.runner.model.model.layers[0].self_attn
        assert attention.sinks.shape == (llm.engine.model_config.num_heads // 2,)
    finally:
        llm.shutdown()
