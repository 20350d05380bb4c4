"""Stacked experts whose weights stay GGUF blocks on the CPU backend (llama.cpp's 3-D
`ffn_{gate,up,down}_exps`, kept by loader/quantized.py's keep_expert_blocks as uint8
[experts, rows, bytes per row] carrying their `ggml_type`), swapped in at load (`install`).

StackedExperts groups a step's tokens by expert and runs each routed expert once on its rows; here an
expert's slice of blocks (its rows are contiguous) goes through the same 2-D block matmul a dense
GGUF linear uses (csrc/quant_matmul.c through ops.quant_matmul), so the sums are that linear's, SiLU
* up computed inside the down projection's call. Only the experts the step routes to are read.
Where both projections are blocks, the activation SiLU * up and there are no biases (every GGUF
Qwen-MoE, Mixtral, OLMoE), the whole layer's routed experts run in one C call instead
(csrc/moe_experts.c: the same kernels on the same rows in the same order, so the same bits, without
a Python loop of two calls per routed expert). The other backends dequantize these tensors at load.

With int8 activations (--cpu-activations int8) a one-call layer's Q4_K, Q5_K and Q6_K projections are
repacked at install into csrc/q8_gemm.c's tiles, each expert's own (its rows a multiple of 16), the
weight's type then carrying INT8_ACTIVATIONS | INT8_REPACKED as a dense linear's does: the C call
multiplies rows of x quantized to Q8_K (gate/up's input once a token, down's once a routed row),
and the per-expert loop runs each expert through the dense int8 GEMM with the same bits. Other types,
and layers that do not take the one call, keep the exact kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from roseinfer.backends.cpu import ops
from roseinfer.backends.cpu.layers import NativeSiluAndMul
from roseinfer.backends.cpu.quantized import INT8_ACTIVATIONS, INT8_REPACKED, is_blocks
from roseinfer.models.moe import StackedExperts


def expert_projection(weight: torch.Tensor, expert: int, x: torch.Tensor) -> torch.Tensor:
    """x @ W[expert].T for stacked W, in blocks or fp32."""
    if is_blocks(weight):
        return ops.quant_matmul(x, weight[expert], weight.ggml_type, None)
    return F.linear(x, weight[expert])


class QuantizedExperts(StackedExperts):
    """StackedExperts with gate/up, down or both in GGUF blocks (each whole or not at all)."""

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = expert_projection(self.gate_up_proj, expert, rows)
        if self.gate_up_proj_bias is not None:  # gpt-oss's, added after the matmul as StackedExperts does
            gate_up += self.gate_up_proj_bias[expert]
        down = self.down_proj
        if is_blocks(down) and isinstance(self.act_and_mul, NativeSiluAndMul) and self.down_proj_bias is None:
            return ops.silu_mul_packed_matmul(gate_up, down[expert].data_ptr(), down.ggml_type, down.shape[1], None)
        out = expert_projection(down, expert, self.act_and_mul.forward(gate_up))
        if self.down_proj_bias is not None:
            out += self.down_proj_bias[expert]
        return out


class OneCallQuantizedExperts(QuantizedExperts):
    """QuantizedExperts with gate/up and down both in blocks, SiLU * up and no biases: all of a step's
    routed experts in one C call, equal bit for bit to QuantizedExperts' loop over them."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(x, weights, experts, self.gate_up_proj, self.down_proj)


def takes_one_call(module: StackedExperts) -> bool:
    return (is_blocks(module.gate_up_proj) and is_blocks(module.down_proj) and module.gate_up_proj_bias is None
            and module.down_proj_bias is None and isinstance(module.act_and_mul, NativeSiluAndMul))


GEMM_ROWS = 16  # csrc/q8_gemm_lanes.h's: the rows of a repacked tile, which must not straddle two experts
# the one call quantizes rows of x to Q8_K, what these take; the repacked 32-block types keep exact kernels here
EXPERT_REPACKED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K"))


def repacked_for_int8(weight: torch.Tensor, in_features: int) -> torch.Tensor | None:
    """Stacked Q4_K or Q6_K blocks [experts, rows, bytes] as csrc/q8_gemm.c's tiles, the same shape with
    each row's share of its tile's bytes, typed for the int8 GEMM; None for another type or rows that
    are not whole tiles."""
    experts, rows = weight.shape[:2]
    if weight.ggml_type not in EXPERT_REPACKED_TYPES or rows % GEMM_ROWS:
        return None
    tiles = ops.repack_for_int8_gemm(weight.reshape(experts * rows, -1), weight.ggml_type, in_features)
    repacked = nn.Parameter(tiles.view(experts, rows, -1), requires_grad=False)
    repacked.ggml_type = weight.ggml_type | INT8_ACTIVATIONS | INT8_REPACKED
    return repacked


@torch.inference_mode()
def install(model: nn.Module, int8_activations: bool = False) -> None:
    """OneCallQuantizedExperts, or QuantizedExperts, in place of the StackedExperts whose weights hold
    blocks (after the backend's layers: the activation must be the native SiLU * up by then); with
    int8_activations a one-call layer's Q4_K, Q5_K and Q6_K projections repacked for the int8 GEMM."""
    for module in model.modules():
        if type(module) is StackedExperts and (is_blocks(module.gate_up_proj) or is_blocks(module.down_proj)):
            one_call = takes_one_call(module)
            module.__class__ = OneCallQuantizedExperts if one_call else QuantizedExperts
            if not (one_call and int8_activations):
                continue
            hidden, width = module.down_proj.shape[1], module.gate_up_proj.shape[1] // 2
            for name, in_features in (("gate_up_proj", hidden), ("down_proj", width)):
                repacked = repacked_for_int8(getattr(module, name), in_features)
                if repacked is not None:
                    setattr(module, name, repacked)
