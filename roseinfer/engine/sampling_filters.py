"""Top-k, top-p and min-p, without sorting the vocabulary when a row's first tokens decide.

The definition (`sort_filter`) sorts each row by value, descending, ties by the lower token id (a
stable sort), keeps its first top_k, and of those keeps a token while the mass before it is at
most top_p and its probability at least min_p times the first one's, probabilities being the
softmax of the first top_k (of the whole row without top_k). Each rule drops a suffix of the
sorted row, so what is kept is a prefix of it.

`candidate_filter` finds that prefix among each row's first W tokens only (one topk over the batch:
W is the largest top_k, or PROBE when a row has none), ordered as the sort orders them and run
through the same softmax and cumsum, so a row it decides keeps exactly the same tokens. It decides
a row when the prefix provably ends inside the candidates: the ties at the row's last candidate
value are all among them, and a row without top_k has already dropped its last candidate. The rows
it cannot decide (a nucleus wider than PROBE, a tie across the W-th value) go to `sort_filter`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
PROBE = 256  # candidates of a row that filters by top-p or min-p alone
# at least this many candidates: softmax sums a row this wide in the same order as the whole
# vocabulary's (one vector register's lanes), so the candidates' probabilities are the same floats
MIN_WIDTH = 64


@dataclass
class FilterSettings:
    """The filtered rows' settings: top_k as host ints (0: none) and device columns [n, 1]."""

    temperature: torch.Tensor
    top_k: list[int]  # 0 where the row has none, or one as wide as the vocabulary
    top_k_col: torch.Tensor  # float; the vocabulary size where top_k is 0
    top_p: torch.Tensor  # inf where it is 1: the whole mass, whatever a sum's last bit says
    min_p: torch.Tensor

    def rows(self, index: list[int]) -> FilterSettings:
        at = torch.tensor(index, device=self.top_p.device)
        return FilterSettings(self.temperature[at], [self.top_k[i] for i in index], self.top_k_col[at], self.top_p[at],
                              self.min_p[at])


@dataclass
class Candidates:
    ids: torch.Tensor  # [n, W] token ids in the sorted order
    logits: torch.Tensor  # [n, W] their logits over temperature, -inf where the filters drop them
    exact: torch.Tensor  # [n] bool: the kept set lies among the candidates (else sort_filter decides)

    def masked(self, vocab: int, row: int) -> torch.Tensor:
        """A row over the whole vocabulary: its candidates' logits in place, -inf elsewhere."""
        return self.logits.new_full((vocab,), NEG_INF).scatter_(0, self.ids[row], self.logits[row])


def width(settings: FilterSettings, vocab: int) -> int:
    widest = max((k if k > 0 else PROBE) for k in settings.top_k)
    return min(max(widest, MIN_WIDTH), vocab)


def candidate_filter(logits: torch.Tensor, settings: FilterSettings) -> Candidates:
    """logits: [n, V]; the candidates' logits come back over temperature, as the filters see them."""
    vocab = logits.shape[1]
    w = width(settings, vocab)
    # the first W + 1 by logit are the first by logit over temperature, up to ties that the
    # division makes, which the re-sort below orders and the check of the last value catches;
    # one past the candidates says whether the last candidate value's ties continue outside them
    values, ids = logits.topk(min(w + 1, vocab), dim=1)
    values = values / settings.temperature
    nxt = values[:, w:w + 1]
    values, ids = values[:, :w], ids[:, :w]
    # topk leaves ties in any order: by id, then stably by value, is the sort's order
    ids, by_id = ids.sort(dim=1)
    values, by_value = values.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    has_k = settings.top_k_col < vocab
    ranks = torch.arange(w, device=logits.device)
    probs = _sorted_probs(values.masked_fill(ranks >= settings.top_k_col, NEG_INF), logits, ids, settings)
    kept = keep_prefix(probs, settings.top_p, settings.min_p) & (ranks < settings.top_k_col)
    if w == vocab:
        exact = torch.ones_like(has_k)
    else:
        # the row's last candidate: its k-th, or the W-th; -inf ties have no mass to misplace
        last = values.gather(1, torch.where(has_k, settings.top_k_col.long() - 1, w - 1))
        exact = (last > nxt) | (last == NEG_INF)
        exact &= has_k | ~kept[:, -1:] | (values[:, -1:] == NEG_INF)
    return Candidates(ids, values.masked_fill(~kept, NEG_INF), exact.squeeze(1))


def sort_filter(logits: torch.Tensor, settings: FilterSettings) -> torch.Tensor:
    """The definition over the whole sorted rows: [n, V] logits over temperature, -inf where the
    filters drop a token."""
    vocab = logits.shape[1]
    scaled = logits / settings.temperature
    sorted_logits, order = scaled.sort(dim=1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= settings.top_k_col, NEG_INF)  # exact in fp32: V < 2**24
    kept = keep_prefix(_sorted_probs(sorted_logits, logits, order, settings), settings.top_p, settings.min_p)
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits.masked_fill(~kept, NEG_INF))


def _sorted_probs(sorted_logits: torch.Tensor, logits: torch.Tensor, order: torch.Tensor,
                  settings: FilterSettings) -> torch.Tensor:
    """The probabilities the filters compare, in the sorted order: a row with top_k takes the
    softmax of its sorted first top_k (any width of at least MIN_WIDTH sums them alike); one
    without takes its whole row's softmax in vocabulary order, which its candidates can too."""
    probs = sorted_logits.softmax(dim=1)
    if all(settings.top_k):
        return probs
    has_k = settings.top_k_col < logits.shape[1]
    return torch.where(has_k, probs, (logits / settings.temperature).softmax(dim=1).gather(1, order))


def keep_prefix(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs sorted descending: keep a token while the mass before it is at most top_p and it is at
    least min_p times the first; the most likely one always stays."""
    drop = (probs.cumsum(dim=1) - probs) > top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    return ~drop
