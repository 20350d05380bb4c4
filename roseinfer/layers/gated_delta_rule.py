"""The gated delta rule (Gated DeltaNet's linear attention) and its short causal convolution, in torch,
over a step's flat batch of sequences, each continuing from the state its slot of the state pool holds.

Per head, with state S [k_dim, v_dim], decay g <= 0 (log space) and learning rate beta in (0, 1):
    S <- exp(g) * S;  S <- S + k (beta * (v - k^T S))^T;  o = q^T S
Decode rows (one token per sequence) take that step directly, batched over sequences and heads.
A verified draft's rows take that step once per position (DraftPosition), so its states are the
floats plain decode of the same tokens gives, one kept per position until sampling says which to keep.
Prefill chunks take the chunked form (the DeltaNet paper's UT transform; flash-linear-attention's
design): inside a chunk of CHUNK tokens the updates become a triangular solve and matmuls, and only
the chunks are scanned in order. Padding tokens carry g = 0, beta = 0 and zero q/k/v, which leaves
the state as it was, so sequences of different lengths share one padded batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and flash-linear-attention's default)


@dataclass
class DraftPosition:
    """Position t of every draft verified this step that is that long: the verify step runs the decode
    recurrence once per position, reading each state from `sources` and leaving it in `targets`, so
    the state after every position is kept and the accepted one is committed after sampling."""

    rows: torch.Tensor  # [n] the positions' rows of the flat batch
    sources: torch.Tensor  # [n] the slot holding each sequence's state before this position
    targets: torch.Tensor  # [n] the slot its state after this position goes to
    keep: torch.Tensor  # [n] ones: a draft always continues its sequence's state


@dataclass
class LinearStateBatch:
    """Which state slot each of a step's sequences uses and where its tokens lie in the flat batch;
    built once per step (backends/base.py) and read by every linear-attention layer."""

    slots: torch.Tensor  # [B] each sequence's slot in the state pool
    keep: torch.Tensor  # [B] 1.0 where the sequence continues its state, 0.0 where it starts at position 0
    decode_seqs: torch.Tensor  # sequences with one row this step
    decode_rows: torch.Tensor  # their rows of the flat batch
    prefill_seqs: torch.Tensor  # sequences with several rows that are not a verified draft
    prefill_rows: torch.Tensor  # [P, L] their rows, padded with row 0
    prefill_valid: torch.Tensor  # [P, L] 1.0 at a real token, 0.0 at padding
    prefill_lens: torch.Tensor  # [P] their rows this step
    draft_positions: list[DraftPosition]  # the verified drafts' rows, position by position

    @classmethod
    def build(cls, slots: list[int], q_starts: list[int], q_lens: list[int], kv_lens: list[int],
              device: torch.device, dtype: torch.dtype,
              draft_scratch: dict[int, int] | None = None) -> "LinearStateBatch":
        """draft_scratch: for each sequence verifying a draft (by index), the first of the scratch slots
        that keep its state after each position but the last, whose state goes to its own slot."""
        draft_scratch = draft_scratch or {}
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        prefill = [i for i, n in enumerate(q_lens) if n > 1 and i not in draft_scratch]
        width = max((q_lens[i] for i in prefill), default=0)
        rows = [[q_starts[i] + j if j < q_lens[i] else 0 for j in range(width)] for i in prefill]
        valid = [[1.0 if j < q_lens[i] else 0.0 for j in range(width)] for i in prefill]

        def longs(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        positions = []
        for t in range(max((q_lens[i] for i in draft_scratch), default=0)):
            seqs = [i for i in draft_scratch if t < q_lens[i]]
            sources = [slots[i] if t == 0 else draft_scratch[i] + t - 1 for i in seqs]
            targets = [slots[i] if t == q_lens[i] - 1 else draft_scratch[i] + t for i in seqs]
            positions.append(DraftPosition(longs([q_starts[i] + t for i in seqs]), longs(sources), longs(targets),
                                           torch.ones(len(seqs), dtype=dtype, device=device)))
        return cls(longs(slots), torch.tensor([float(kv - q > 0) for q, kv in zip(q_lens, kv_lens)], dtype=dtype,
                                              device=device),
                   longs(decode), longs([q_starts[i] for i in decode]), longs(prefill),
                   longs(rows).view(len(prefill), width), torch.tensor(valid, dtype=dtype, device=device).view(
                       len(prefill), width), longs([q_lens[i] for i in prefill]), positions)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's, as transformers writes it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, C], conv_state [B, C, K - 1] (the previous inputs), weight [C, K].
    Returns (silu(conv) [B, C], the next conv state)."""
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    return F.silu((window * weight).sum(-1)), window[:, :, 1:]


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                 lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, C] (right-padded), conv_state [B, C, K - 1], weight [C, K], lens [B]. Returns
    (silu(conv) [B, L, C], each sequence's next conv state: the K - 1 inputs before its end)."""
    history = conv_state.shape[-1]
    window = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + L]
    out = F.conv1d(window, weight.unsqueeze(1), groups=weight.shape[0])  # [B, C, L]
    ends = (lens.view(-1, 1) + torch.arange(history, device=x.device)).unsqueeze(1).expand(-1, window.shape[1], -1)
    return F.silu(out).transpose(1, 2), window.gather(2, ends)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, Dk] (normalised, q scaled), v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] in float32. Returns (o [B, H, Dv], the next state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of several tokens: q, k [B, L, H, Dk] (normalised, q scaled), v [B, L, H, Dv],
    g, beta [B, L, H], state [B, H, Dk, Dv], all float32, padding zeroed. Returns (o [B, L, H, Dv],
    the state after each sequence's last token)."""
    length = q.shape[1]
    pad = (-length) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))  # [B, H, L', D]
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2) for t in (g, beta))  # [B, H, L']
    batch, heads, padded, k_dim = k.shape
    n = padded // chunk
    q, k, v = (t.reshape(batch, heads, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(batch, heads, n, chunk), beta.reshape(batch, heads, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay between positions j <= i of a chunk; masked above the diagonal before exp (no overflow)
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # the UT transform: (I + strictly-lower(beta k k^T * decay)) W = [beta v, beta k * decay]; the
    # solve reads the strictly lower triangle only (unitriangular)
    system = (k_beta @ k.transpose(-1, -2)) * between
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * decay.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, k_decayed = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    scores = (q @ k.transpose(-1, -2)) * between  # within the chunk, causal
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(n):
        fresh = values[:, :, i] - k_decayed[:, :, i] @ state  # what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ fresh
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ fresh
    out = out.reshape(batch, heads, padded, -1)[:, :, :length].transpose(1, 2)
    return out, state
