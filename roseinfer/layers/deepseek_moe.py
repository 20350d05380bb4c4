"""DeepSeek's mixture of experts: the router (V2's softmax top-k, greedy or group-limited; V3's sigmoid
scores with a correction bias and group-limited top-k), as transformers' DeepseekV2Moe / DeepseekV3MoE
choose: `route(hidden, router) -> (weights [T, k], ids [T, k])`, what models/moe.py's StackedExperts
takes (models/deepseek.py runs the routed experts there and adds the shared ones).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.deepseek_layouts import DeepseekRouting


class DeepseekRouter(nn.Module):
    """The gate: a float32 score per expert; V3 adds a bias that steers the choice, not the weights."""

    def __init__(self, hidden_size: int, routing: DeepseekRouting) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.zeros(routing.num_experts, hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(routing.num_experts))
                                        if routing.scoring == "sigmoid" else None)


def route(hidden: torch.Tensor, router: DeepseekRouter) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their float32 weights, [T, top_k] each. Ties go to the lower expert
    (group) index: a stable sort, where transformers' topk leaves the order of equal scores unsaid."""
    routing = router.routing
    logits = F.linear(hidden.float(), router.weight.float())
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores if router.e_score_correction_bias is None else scores + router.e_score_correction_bias.float()
    if routing.num_groups > 1:
        grouped = choice.view(-1, routing.num_groups, routing.num_experts // routing.num_groups)
        if routing.group_by == "top2":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        groups = _top(group_scores, routing.top_groups)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        # as transformers: V2 zeroes the other groups' scores (its weights come from them), V3 rules them out
        dropped = 0.0 if routing.scoring == "softmax" else float("-inf")
        choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[2], dim=1), dropped)
    ids = _top(choice, routing.top_k)
    weights = (choice if routing.scoring == "softmax" else scores).gather(1, ids)
    if routing.normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling_factor, ids


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True)[1][:, :k]
