"""DeepSeek's mixture of experts: the router (V2's softmax top-k, greedy or group-limited; V3's sigmoid
scores with a correction bias and group-limited top-k) and the routed experts computed token group by
token group, as transformers' DeepseekV2Moe / DeepseekV3MoE (models/deepseek.py adds the shared experts).

The interface the engine's MoE layers share: `route(hidden, router) -> (weights [T, k], ids [T, k])`
and `RoutedExperts.forward(hidden, weights, ids) -> out`. The experts' compute is the plainest exact
one: each expert that any token chose runs once, on its tokens' rows, in expert order (transformers'
order of accumulation, so fp32 sums round as it does).
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


class RoutedExperts(nn.ModuleList):
    """The routed experts, any modules mapping [rows, hidden] to [rows, hidden] (models/deepseek.py Expert)."""

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(token), [T, hidden]."""
        out = torch.zeros_like(hidden)
        flat_ids = ids.flatten()
        order = torch.sort(flat_ids, stable=True)[1]  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=len(self)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // ids.shape[1]
                rows = self[expert].forward(hidden[tokens]) * weights.flatten()[pairs].unsqueeze(1)
                out.index_add_(0, tokens, rows.to(out.dtype))
                start += count
        return out
