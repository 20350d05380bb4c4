"""Mixture-of-experts weights kept as GGUF blocks on the CPU backend (backends/cpu/quantized_experts.py):
the grouped expert compute against a per-token reference through the same block kernel and against
the dequantized weights, the one-call path (csrc/moe_experts.c) against the per-expert loop bit for
bit, routing with ties and with every token on one expert, and whole models written to GGUF in
Q8_0 / Q4_K against HF on the dequantized weights in every scheduling mode the CPU backend runs."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import layers as cpu_layers
from roseinfer.backends.cpu import quantized_experts
from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.quantized_experts import OneCallQuantizedExperts, QuantizedExperts
from roseinfer.distributed.parallel import SINGLE
from roseinfer.loader.gguf import convert_gguf
from roseinfer.models.config import MoeLayout
from roseinfer.models.moe import SparseMoeBlock, StackedExperts, select_experts
from test_moe import MODES
from test_native_kernels import needs_kernels
from test_quantized import QTYPES, random_blocks

EXPERTS, HIDDEN, WIDTH = 4, 256, 256  # K-quant rows are whole 256-blocks


def _experts(gate_up: QT | None, down: QT | None, seed: int = 0,
             bias: bool = False) -> tuple[StackedExperts, StackedExperts]:
    """(QuantizedExperts with the projections of the given types in blocks (None: fp32), StackedExperts
    on the same weights dequantized), both with the CPU backend's SiLU * up; with `bias`, the same
    random biases (gpt-oss's) on both."""
    rng = np.random.default_rng(seed)
    dense = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE, bias=bias)
    blocks = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE, bias=bias)
    for name in ("gate_up_proj_bias", "down_proj_bias") if bias else ():
        values = torch.from_numpy(rng.standard_normal(getattr(dense, name).shape).astype(np.float32))
        getattr(dense, name).data.copy_(values)
        getattr(blocks, name).data.copy_(values)
    for name, qtype in (("gate_up_proj", gate_up), ("down_proj", down)):
        rows, cols = getattr(dense, name).shape[1:]
        if qtype is None:
            values = torch.from_numpy(rng.standard_normal((EXPERTS, rows, cols)).astype(np.float32))
            getattr(dense, name).data.copy_(values)
            getattr(blocks, name).data.copy_(values)
            continue
        parts = [random_blocks(qtype, rows, cols, seed=seed * 10 + e) for e in range(EXPERTS)]
        param = torch.nn.Parameter(torch.stack([raw for raw, _ in parts]), requires_grad=False)
        param.ggml_type = int(qtype)
        setattr(blocks, name, param)
        getattr(dense, name).data.copy_(torch.stack([values for _, values in parts]))
    cpu_layers.install(dense)
    cpu_layers.install(blocks)
    quantized_experts.install(blocks)
    return blocks, dense


def _per_token(experts: QuantizedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token alone, its experts in ascending order, each projection one row through the block
    kernel (whose sums round by how many rows it is given: equal to the grouped compute up to that)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in ids[t].argsort(stable=True).tolist():
            e = int(ids[t, slot])
            gate_up = ops.quant_matmul(x[t:t + 1], experts.gate_up_proj[e], experts.gate_up_proj.ggml_type, None)
            h = experts.act_and_mul.forward(gate_up)
            out[t] += (ops.quant_matmul(h, experts.down_proj[e], experts.down_proj.ggml_type, None) * weights[t, slot])[0]
    return out


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_grouped_experts_equal_each_token_alone(qtype: QT) -> None:
    """A batch of 9 tokens, top-2 of 4 experts (some experts with one token, some with many): each
    token's output is what it gets alone, and what the dequantized weights give in fp32."""
    blocks, dense = _experts(qtype, qtype)
    torch.manual_seed(0)
    x = torch.randn(9, HIDDEN)
    ids = torch.tensor([[0, 1], [1, 0], [2, 0], [0, 3], [1, 2], [0, 1], [3, 0], [0, 2], [1, 0]])
    weights = torch.rand(9, 2)
    got = blocks.forward(x, weights, ids)
    alone = _per_token(blocks, x, weights, ids)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    want = dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())



def _per_expert_loop(experts: OneCallQuantizedExperts, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """The same module through QuantizedExperts' loop: two block-kernel calls per routed expert."""
    return QuantizedExperts.forward(experts, x, weights, ids)


@needs_kernels
@pytest.mark.parametrize("types", [(q, q) for q in QTYPES] + [(QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q4_0)],
                         ids=[q.name for q in QTYPES] + ["Q4_K+Q6_K", "Q8_0+Q4_0"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_one_call_equals_the_per_expert_loop_bit_for_bit(types: tuple[QT, QT], tokens: int) -> None:
    """Random top-3 routing of 1, 7 and 40 tokens over 4 experts (40: every expert past the tiled
    kernel's 17 rows, 7: partial row groups): the one C call gives the loop's bits; a Q4_K_M file's
    gate/up and down types differ."""
    blocks, dense = _experts(*types, seed=4)
    assert type(blocks) is OneCallQuantizedExperts
    torch.manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN)
    weights, ids = select_experts(torch.randn(tokens, EXPERTS), 3, renormalize=False)
    got = blocks.forward(x, weights, ids)
    assert torch.equal(got, _per_expert_loop(blocks, x, weights, ids))
    want = dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())



def on_one_thread(forward: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """forward(*args) with torch's thread count at 1 (a call's work items then all fall to one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return forward(*args)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0)], ids=["Q4_K+Q6_K", "Q8_0"])
def test_one_call_with_whole_experts_as_items_equals_the_loop(types: tuple[QT, QT]) -> None:
    """48 tokens of top-3 over 4 experts on one thread: 36 rows an expert on average, enough experts
    for the thread, so each expert is one work item (a prefill's case) rather than slices of rows."""
    blocks, _ = _experts(*types, seed=6)
    torch.manual_seed(6)
    x = torch.randn(48, HIDDEN)
    weights, ids = select_experts(torch.randn(48, EXPERTS), 3, renormalize=True)
    assert torch.equal(on_one_thread(blocks.forward, x, weights, ids), _per_expert_loop(blocks, x, weights, ids))

@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_one_call_with_every_token_on_one_expert(tokens: int) -> None:
    """Every token on experts 3 and 1, given in that order (the sum still adds expert 1's row first);
    the other experts get no rows."""
    blocks, dense = _experts(QT.Q4_K, QT.Q6_K, seed=5)
    assert type(blocks) is OneCallQuantizedExperts
    torch.manual_seed(5)
    x = torch.randn(tokens, HIDDEN)
    ids = torch.tensor([[3, 1]]).expand(tokens, 2).contiguous()
    weights = torch.rand(tokens, 2)
    got = blocks.forward(x, weights, ids)
    assert torch.equal(got, _per_expert_loop(blocks, x, weights, ids))
    want = dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernels
def test_one_call_refuses_an_expert_id_out_of_range() -> None:
    blocks, _ = _experts(QT.Q8_0, QT.Q8_0)
    with pytest.raises(ValueError, match="expert id"):
        blocks.forward(torch.randn(2, HIDDEN), torch.rand(2, 2), torch.tensor([[0, 1], [2, EXPERTS]]))

@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K], ids=["Q8_0", "Q4_K"])
def test_each_experts_biases_are_added_on_the_block_path(qtype: QT) -> None:
    """gpt-oss's expert biases, on weights kept in blocks: the fp32 weights' output, not the unbiased one."""
    blocks, dense = _experts(qtype, qtype, seed=3, bias=True)
    assert type(blocks) is QuantizedExperts
    torch.manual_seed(3)
    x = torch.randn(6, HIDDEN)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2)
    got, want = blocks.forward(x, weights, ids), dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())
    unbiased, _ = _experts(qtype, qtype, seed=3)
    assert not torch.allclose(unbiased.forward(x, weights, ids), want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_token_on_one_expert(tokens: int) -> None:
    """All tokens routed to the same two experts: one expert's rows (40 of them take the dequantized
    slices' matmul) against the fp32 weights; down in blocks of another type, gate/up fp32."""
    blocks, dense = _experts(None, QT.Q6_K, seed=1)
    assert type(blocks) is QuantizedExperts
    torch.manual_seed(1)
    x = torch.randn(tokens, HIDDEN)
    ids = torch.tensor([[3, 1]]).expand(tokens, 2).contiguous()
    weights = torch.full((tokens, 2), 0.5)
    got = blocks.forward(x, weights, ids)
    want = dense.forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernels
def test_router_ties_pick_the_experts_torch_topk_picks() -> None:
    """A router whose logits all tie (zero weights): every token goes to the same two experts (those
    torch.topk picks, as in transformers) with equal weights; the blocks' layer equals the fp32 one."""
    layout = MoeLayout(num_experts=EXPERTS, top_k=2, expert_width=WIDTH, norm_topk_prob=True, shared_expert_width=0,
                       sparse_layers=(0,))
    moe = SparseMoeBlock(HIDDEN, layout, "silu")
    reference = SparseMoeBlock(HIDDEN, layout, "silu")
    blocks, dense = _experts(QT.Q8_0, QT.Q8_0, seed=2)
    moe.experts, reference.experts = blocks, dense
    moe.gate.weight.data.zero_()
    reference.gate.weight.data.zero_()
    x = torch.randn(6, HIDDEN)
    weights, ids = select_experts(moe.gate.forward(x), 2, renormalize=True)
    assert len({tuple(row) for row in ids.tolist()}) == 1 and torch.equal(weights, torch.full_like(weights, 0.5))
    got = moe.forward(x)
    assert type(blocks) is OneCallQuantizedExperts and torch.equal(got, _per_expert_loop(blocks, x, weights, ids))
    want = reference.forward(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


def _tiny_moe_hf() -> torch.nn.Module:
    """A random Qwen3-MoE (a dense first layer, top-2 of 4 experts) whose 2-D and 3-D weights are
    scaled up, so greedy logits are far from ties."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                                      norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=128,
                                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if p.dim() >= 2:
                p.mul_(4.0)
    return model


def _hf_greedy_on_dequantized(model: torch.nn.Module, folder: Path, prompts: list[list[int]],
                              max_new_tokens: int) -> list[list[int]]:
    """HF's greedy tokens with the weights of the file's fp32 conversion (folder), its stacked
    experts' gate and up put back into transformers 5's gate_up_proj."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    for name in [n for n in state if ".mlp.experts.gate_proj." in n]:
        up = state.pop(name.replace("gate_proj", "up_proj"))
        state[name.replace("gate_proj.weight", "gate_up_proj")] = torch.cat([state.pop(name), up], dim=1)
    for name in [n for n in state if ".mlp.experts.down_proj." in n]:
        state[name.removesuffix(".weight")] = state.pop(name)
    model.load_state_dict(state, strict=True)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


# the scheduling modes of tests/test_moe.py that run on the CPU backend (the others dequantize the experts)
CPU_MODES = {name: options for name, options in MODES.items() if "attention_backend" not in options}


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K"])
def moe_gguf(request, tmp_path_factory) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    """(type, a tiny Qwen3-MoE GGUF of that type, prompts, HF's greedy tokens on its dequantized weights)."""
    folder = tmp_path_factory.mktemp(f"moe_{request.param}")
    hf = _tiny_moe_hf()
    src = write_tiny_gguf(folder / "moe.gguf", hf, make_tiny_tokenizer(300), request.param)
    prompts = [[5, 17, 42, 9], list(range(3, 60)), [7, 7, 8, 7, 7, 8, 7, 7, 8, 7, 7]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROSEINFER_CACHE_DIR", str(folder / "cache"))
        refs = _hf_greedy_on_dequantized(hf, convert_gguf(src), prompts, 12)
    assert any(len(set(r)) > 2 for r in refs), "degenerate reference"
    return request.param, src, prompts, refs


@needs_kernels
@pytest.mark.parametrize("mode", list(CPU_MODES))
def test_moe_model_in_blocks_matches_hf_on_the_dequantized_weights(moe_gguf, monkeypatch: pytest.MonkeyPatch,
                                                                    mode: str) -> None:
    """The experts stay in their 3-D blocks (quantization gguf) and run in one call a layer; the
    engine generates what HF generates from the dequantized weights, token for token, in decode and
    in prefill of many rows, in every scheduling mode."""
    qtype, src, prompts, refs = moe_gguf
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(src.parent / "cache"))
    llm = LLM(model=str(src), quantization="gguf", **{"num_kv_blocks": 32, **CPU_MODES[mode]})
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert type(experts) is OneCallQuantizedExperts and experts.gate_up_proj.dtype == torch.uint8
    assert experts.gate_up_proj.shape[:2] == (EXPERTS, 2 * WIDTH) and int(experts.down_proj.ggml_type) == int(QT[qtype])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert llm.kv_cache_stats()["used_blocks"] == 0


@needs_kernels
def test_other_backends_dequantize_expert_blocks_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gguf(tmp_path / "moe.gguf", _tiny_moe_hf(), make_tiny_tokenizer(300), "Q8_0")
    llm = LLM(model=str(src), attention_backend="torch", num_kv_blocks=32)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert type(experts) is StackedExperts and experts.gate_up_proj.dtype == torch.float32
