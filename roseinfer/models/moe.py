"""A softmax-routed mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE), built from a
MoeLayout (models/config.py) so that other families' decoder layers can take it as their MLP.

Routing is transformers': softmax over the router's logits in fp32, top-k, renormalised where
`norm_topk_prob`. The expert compute reads only the experts the step routes to: the step's
(token, slot) pairs are sorted by expert, each touched expert runs once on its tokens' rows (gate/up,
act * up, down, times the routing weight), and each token's k results are then added to zero in
ascending expert order, the order transformers' loop over experts adds them in, so the sums round
as the reference's do.

Under tensor parallelism each rank holds its slice of every expert's width (gate/up rows, down
columns), as for a dense MLP: every rank routes the same tokens to the same experts, so the work is
even however skewed the routing, and one all-reduce of the layer's output is the only exchange
(holding whole experts per rank would need an all-to-all of tokens and leave ranks idle when the
router favours a few experts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.distributed.parallel import SINGLE, TensorParallel, column_parallel, row_parallel
from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.linear import Linear
from roseinfer.models.config import MoeLayout

# a checkpoint's per-expert projection -> (this module's stacked parameter, its half of gate_up)
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", None),
                      "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> each token's top_k (weights [T, k] in the logits' dtype, expert ids
    [T, k]): softmax over every expert in fp32, top-k, renormalised to sum to 1 where asked."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class StackedExperts(nn.Module):
    """Every expert's gate/up [E, 2 w, H] and down [E, H, w], w being this rank's share of the expert
    width; run only on the rows routed to each. With `bias` (gpt-oss) each projection adds its
    expert's bias after the matmul; `act_and_mul` maps gate/up to the down projection's input
    (act(gate) * up of `hidden_act` where not given)."""

    def __init__(self, num_experts: int, hidden_size: int, expert_width: int, hidden_act: str,
                 tp: TensorParallel, bias: bool = False, act_and_mul: nn.Module | None = None) -> None:
        super().__init__()
        self.width = tp.even(expert_width)
        self.rank = tp.rank
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.width.rows, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.width.rows), requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * self.width.rows), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.act_and_mul = act_and_mul if act_and_mul is not None else ActivationAndMul(hidden_act)
        self._filled: dict[str, set[tuple[int | None, int | None]]] = {"gate_up_proj": set(), "down_proj": set()}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and expert ids [T, k] -> sum over each token's experts [T, H]."""
        tokens, top_k = experts.shape
        # pairs numbered slot-major (slot * T + token) and grouped by expert: within an expert, rows
        # in transformers' order, which a small matmul's rounding can depend on
        flat = experts.t().flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        per_pair = torch.empty(top_k * tokens, x.shape[1], dtype=x.dtype, device=x.device)
        flat_weights = weights.t().flatten()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            per_pair[pairs] = self.expert_mlp(expert, x[pairs % tokens]) * flat_weights[pairs, None]
        per_slot = per_pair.view(top_k, tokens, -1)
        by_expert = experts.argsort(dim=1, stable=True)  # each token's slots in ascending expert order
        rows = torch.arange(tokens, device=x.device)
        out = torch.zeros_like(x)
        for rank in range(top_k):
            out += per_slot[by_expert[:, rank], rows]
        return out

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's gate/up, act * up and down on the rows routed to it [n, H] -> [n, H]."""
        gate_up = F.linear(rows, self.gate_up_proj[expert])
        if self.gate_up_proj_bias is not None:
            gate_up += self.gate_up_proj_bias[expert]
        down = F.linear(self.act_and_mul.forward(gate_up), self.down_proj[expert])
        if self.down_proj_bias is not None:
            down += self.down_proj_bias[expert]
        return down

    def load(self, projection: str, expert: int | None, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor: a projection (EXPERT_PROJECTIONS' names) of one expert [out, in],
        or of all of them stacked [E, out, in] (expert None); this rank takes its share. True once
        the parameter it fills is whole."""
        target, half = EXPERT_PROJECTIONS[projection]
        part = self.width
        if part.rows != part.size:  # whole on one rank: a tensor kept in GGUF blocks is loaded as it is
            tensor = tensor.narrow(-1 if target == "down_proj" else -2, part.start, part.rows)
        param = getattr(self, target)
        rows = param.data if half is None else param.data.narrow(1, half * part.rows, part.rows)
        destination = rows if expert is None else rows[expert]
        if destination.shape != tensor.shape:
            raise ValueError(f"expert tensor {projection} has shape {tuple(tensor.shape)} (this rank's share), "
                             f"the model expects {tuple(destination.shape)}")
        destination.copy_(tensor)
        filled = self._filled[target]
        filled.update((e, half) for e in (range(self.num_experts) if expert is None else [expert]))
        return len(filled) == self.num_experts * (1 if half is None else 2)


    def load_bias(self, projection: str, tensor: torch.Tensor) -> bool:
        """Every expert's bias of `projection`: gate_up_proj [E, 2 w] (gate's then up's), gate_proj or
        up_proj [E, w], this rank's share of each; down_proj [E, H] on rank 0 alone, zeros elsewhere
        (the layer's all-reduce adds the ranks' partial sums). True once the parameter it fills is whole."""
        part = self.width
        halves = {"gate_up_proj": (0, 1), "gate_proj": (0,), "up_proj": (1,)}.get(projection, ())
        param = self.down_proj_bias if not halves else self.gate_up_proj_bias
        if param is None:
            raise ValueError(f"expert bias {projection} fits no parameter of this model")
        if not halves:
            destinations, sources = [param.data], [tensor if self.rank == 0 else torch.zeros_like(tensor)]
        else:
            destinations = [param.data.narrow(-1, half * part.rows, part.rows) for half in halves]
            sources = [piece.narrow(-1, part.start, part.rows) for piece in tensor.chunk(len(halves), dim=-1)]
        for destination, source in zip(destinations, sources):
            if destination.shape != source.shape:
                raise ValueError(f"expert bias {projection} has shape {tuple(tensor.shape)}, which does not fit "
                                 f"{tuple(param.shape)}")
            destination.copy_(source)
        filled = self._filled.setdefault(f"{'down' if not halves else 'gate_up'}_proj_bias", set())
        filled.update((None, half) for half in halves or (None,))
        return len(filled) == (1 if not halves else 2)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP every token runs, scaled by sigmoid(gate(x)).
    Its output is this rank's partial sum, added to the experts' before the layer's one all-reduce."""

    def __init__(self, hidden_size: int, width: int, hidden_act: str, tp: TensorParallel) -> None:
        super().__init__()
        share = tp.even(width)
        self.gate_up_proj = column_parallel(hidden_size, [share, share], bias=False)
        self.down_proj = row_parallel(width, hidden_size, tp, bias=False)
        self.act_and_mul = ActivationAndMul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_and_mul.forward(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """router -> the routed experts (+ the gated shared expert) -> one all-reduce."""

    def __init__(self, hidden_size: int, layout: MoeLayout, hidden_act: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Linear(hidden_size, layout.num_experts, bias=False)  # the router, whole on every rank
        self.top_k, self.renormalize = layout.top_k, layout.norm_topk_prob
        self.experts = StackedExperts(layout.num_experts, hidden_size, layout.expert_width, hidden_act, tp)
        self.shared_expert = None
        self.shared_expert_gate = None
        if layout.shared_expert_width:
            self.shared_expert = SharedExpert(hidden_size, layout.shared_expert_width, hidden_act, tp)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. meta, the step's metadata, is taken as a dense MLP takes it (the decoder
        layer calls both alike) and not read: the whole step's rows go through at once."""
        weights, experts = select_experts(self.gate.forward(x), self.top_k, self.renormalize)
        out = self.experts.forward(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return self.tp.all_reduce(out)
