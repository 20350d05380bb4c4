"""Mixture-of-experts expert compute in Triton (vLLM's and SGLang's fused-MoE design): a step's
(token, slot) pairs sorted by expert into blocks of BLOCK_M pairs that each belong to one expert
(`align_pairs`, in torch), then one grouped GEMM kernel launch for every expert's gate/up and one
for every expert's down projection, each block of pairs multiplying its expert's weights. The
activation between them is the layer's own (SiLU * up, gpt-oss's clamped SwiGLU) in torch; the down
projection scales each pair by its routing weight, and each token's k pairs are summed in torch.

Nothing here reads a count back to the host: the grid is sized from the step's shape (an upper bound
on the blocks), and blocks past the last expert's exit at once, so a decode step can be captured in a
CUDA graph. Weights are dense (fp32, fp16 or bf16), as the Triton backend loads them; the products
accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from roseinfer.backends.triton.kernels import _dot_precision
from roseinfer.models.moe import StackedExperts

BLOCK_N = 64
BLOCK_K = 32
# pairs per block: 16 (tl.dot's smallest tile) while a step has few pairs per expert (decode), then 64
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
LARGE_BLOCK_MIN_PAIRS = 1024


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (pair ids [blocks * block_m], expert of each block [blocks]). Pair p is
    token p // k's slot p % k; each expert's pairs, in pair order, fill whole blocks of their own, the
    last one padded with the id T * k (no pair); blocks past the last expert's have expert -1. blocks
    is an upper bound known from the shape alone: each expert with pairs adds at most one part block."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    num_blocks = min(triton.cdiv(num_pairs, block_m) + num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks_per_expert = (counts + block_m - 1) // block_m
    blocks_end = blocks_per_expert.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    destination = (blocks_end - blocks_per_expert)[sorted_experts] * block_m + rank_in_expert
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=flat.device)
    pair_ids[destination] = order
    block_experts = torch.searchsorted(blocks_end, torch.arange(num_blocks, device=flat.device), right=True)
    return pair_ids, torch.where(block_experts < num_experts, block_experts, -1)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, pair_ids_ptr, block_experts_ptr,
                         num_pairs, n_out, k_in, stride_a_row, stride_w_expert, stride_w_row, stride_bias_expert,
                         stride_out_row, PAIRS_PER_A_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (block of pairs, tile of output columns): out[pair, cols] = a[pair's row] @ W[expert][cols]^T
    # (+ bias[expert][cols]) (* scale[pair]). a's rows are tokens (PAIRS_PER_A_ROW = k: a pair reads its
    # token's row) or pairs (1).
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    a_rows = pairs // PAIRS_PER_A_ROW
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    w_base = w_ptr + expert * stride_w_expert + cols[None, :] * stride_w_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_row + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_expert + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out_row + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pair_mask[:, None] & col_mask[None, :])


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                 pair_ids: torch.Tensor, block_experts: torch.Tensor, num_pairs: int, pairs_per_a_row: int,
                 block_m: int) -> torch.Tensor:
    """[num_pairs, N]: each pair's row of a [rows, K] (row pair // pairs_per_a_row) times its expert's
    weight [E, N, K] transposed, plus bias [E, N], times scale [num_pairs], as align_pairs laid out."""
    if a.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("grouped_gemm needs a's rows and each weight row contiguous")
    out = torch.empty(num_pairs, weight.shape[1], dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(weight.shape[1], BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, weight, bias if bias is not None else weight, scale if scale is not None else weight, out, pair_ids,
        block_experts, num_pairs, weight.shape[1], weight.shape[2], a.stride(0), weight.stride(0), weight.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0), PAIRS_PER_A_ROW=pairs_per_a_row,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=_dot_precision(a.dtype))
    return out


class TritonFusedExperts(StackedExperts):
    """StackedExperts whose routed experts run as two grouped GEMM launches a step."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        tokens, top_k = experts.shape
        num_pairs = tokens * top_k
        if num_pairs == 0:
            return torch.zeros_like(x)
        block_m = SMALL_BLOCK_M if num_pairs < LARGE_BLOCK_MIN_PAIRS else LARGE_BLOCK_M
        pair_ids, block_experts = align_pairs(experts, self.num_experts, block_m)
        gate_up = grouped_gemm(x.contiguous(), self.gate_up_proj, self.gate_up_proj_bias, None, pair_ids,
                               block_experts, num_pairs, top_k, block_m)
        down = grouped_gemm(self.act_and_mul.forward(gate_up).contiguous(), self.down_proj, self.down_proj_bias,
                            weights.flatten().contiguous(), pair_ids, block_experts, num_pairs, 1, block_m)
        return down.view(tokens, top_k, -1).sum(dim=1)


def install(model: nn.Module) -> None:
    """TritonFusedExperts in place of every StackedExperts (the parameters stay where they are)."""
    for module in model.modules():
        if type(module) is StackedExperts:
            module.__class__ = TritonFusedExperts
