"""The Triton fused-MoE expert compute (roseinfer/backends/triton/fused_moe.py) against the torch
per-expert reference (models/moe.py StackedExperts): random routing, every token on one expert,
router ties, top-k of 2 and 3, experts with no tokens, biases, both block heights; and the aligned
block layout itself. Without a CUDA device it runs on CPU tensors in Triton's interpreter
(tests/triton_interpret.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import triton_interpret

pytest.importorskip("triton")
triton_interpret.patch_interpreter()

from roseinfer.backends.triton import fused_moe  # noqa: E402
from roseinfer.backends.triton.fused_moe import TritonFusedExperts, align_pairs  # noqa: E402
from roseinfer.distributed.parallel import SINGLE  # noqa: E402
from roseinfer.models.moe import StackedExperts, select_experts  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = triton_interpret.device()
NUM_EXPERTS, HIDDEN, WIDTH = 8, 48, 40  # neither a multiple of the kernel's 32-wide K tiles nor its 64-wide N tiles


def _experts_pair(bias: bool, seed: int) -> tuple[StackedExperts, TritonFusedExperts]:
    """A StackedExperts with random weights and a TritonFusedExperts holding the same (install's swap)."""
    torch.manual_seed(seed)
    reference = StackedExperts(NUM_EXPERTS, HIDDEN, WIDTH, "silu", SINGLE, bias=bias)
    for p in reference.parameters():
        p.data.copy_(torch.randn(p.shape) * 0.3)
    fused = copy.deepcopy(reference).to(DEVICE)
    fused_moe.install(fused)
    assert type(fused) is TritonFusedExperts
    return reference, fused


def _routing(kind: str, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=g)
    if kind == "one_expert":
        logits[:, 5] += 6.0  # first for every token, the other slots still weighing in
    elif kind == "ties":
        logits = torch.zeros(tokens, NUM_EXPERTS)
    weights, experts = select_experts(logits, top_k, renormalize=True)
    if kind == "one_expert":
        assert (experts[:, 0] == 5).all()
    if kind == "ties":
        # every token picks the same k experts (which ones torch.topk breaks the tie to), at equal weights
        assert (experts == experts[0]).all() and (weights == weights[0, 0]).all()
    return weights, experts


# (routing, tokens, top_k, bias): 600 tokens of top-2 are 1200 pairs, past LARGE_BLOCK_MIN_PAIRS
CASES = [("random", 37, 2, False), ("random", 3, 3, False), ("one_expert", 21, 2, False), ("ties", 19, 3, False),
         ("random", 13, 2, True), ("random", 600, 2, False)]


@pytest.mark.parametrize("routing, tokens, top_k, bias", CASES)
def test_fused_experts_match_the_torch_reference(routing: str, tokens: int, top_k: int, bias: bool) -> None:
    reference, fused = _experts_pair(bias, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, experts = _routing(routing, tokens, top_k)
    with torch.no_grad():
        expected = reference.forward(x, weights, experts)
        got = fused.forward(x.to(DEVICE), weights.to(DEVICE), experts.to(DEVICE)).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if tokens * top_k < NUM_EXPERTS:
        assert experts.unique().numel() < NUM_EXPERTS  # some experts have no tokens


# half precision: reference and kernel read the same rounded weights and inputs; the kernel also rounds
# gate/up before the activation and each pair's product before the sum
HALF_TOL = {torch.float16: {"atol": 5e-2, "rtol": 1e-2}, torch.bfloat16: {"atol": 0.25, "rtol": 5e-2}}


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter's tl.dot "
                                                          "multiplies bf16 operands as their raw uint16 bits")),
], ids=["fp16", "bf16"])
def test_half_precision_experts_match_the_rounded_reference(dtype: torch.dtype) -> None:
    reference, fused = _experts_pair(bias=True, seed=4)
    fused.to(dtype)
    for p in reference.parameters():
        p.data.copy_(p.data.to(dtype).float())
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    weights, experts = _routing("random", 29, 3)
    with torch.no_grad():
        expected = reference.forward(x.float(), weights.to(dtype).float(), experts)
        got = fused.forward(x.to(DEVICE), weights.to(DEVICE, dtype), experts.to(DEVICE))
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), expected, **HALF_TOL[dtype])


@pytest.mark.parametrize("block_m", [16, 64])
def test_aligned_layout_puts_each_pair_once_in_a_block_of_its_expert(block_m: int) -> None:
    experts = _routing("random", 45, 3)[1]
    experts[:20, 0] = 2  # one expert with more pairs than a block of 16
    pair_ids, block_experts = align_pairs(experts, NUM_EXPERTS, block_m)
    num_pairs = experts.numel()
    assert pair_ids.numel() == block_experts.numel() * block_m
    real = pair_ids[pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    blocks = pair_ids.view(-1, block_m)
    flat = experts.flatten()
    for block, expert in zip(blocks, block_experts.tolist()):
        pairs = block[block < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
            continue
        assert pairs.numel() > 0 and (flat[pairs] == expert).all()
        assert torch.equal(pairs, pairs.sort().values)  # in pair order within the expert
    used = block_experts[block_experts >= 0]
    assert torch.equal(used, used.sort().values)
    counts = torch.bincount(flat, minlength=NUM_EXPERTS)
    assert used.numel() == int(((counts + block_m - 1) // block_m).sum())
