"""The gated delta rule's kernels (layers/gated_delta_rule.py) against a float64 reference written
token by token: the recurrence, the chunked form over long sequences, padding, the causal conv across
chunk boundaries."""
from __future__ import annotations

import pytest
import torch

from roseinfer.layers.gated_delta_rule import (chunked_prefill, conv_decode, conv_prefill, l2_normalise,
                                               recurrent_step)


def _delta_rule_inputs(batch: int, length: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = l2_normalise(torch.randn(batch, length, heads, k_dim, generator=g, dtype=torch.float64)) * k_dim ** -0.5
    k = l2_normalise(torch.randn(batch, length, heads, k_dim, generator=g, dtype=torch.float64))
    v = torch.randn(batch, length, heads, v_dim, generator=g, dtype=torch.float64)
    decay = -torch.rand(batch, length, heads, generator=g, dtype=torch.float64) * 0.3
    beta = torch.rand(batch, length, heads, generator=g, dtype=torch.float64)
    state = torch.randn(batch, heads, k_dim, v_dim, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, decay, beta, state)]


def _reference(q, k, v, decay, beta, state):
    """The delta rule token by token in float64, written out per head."""
    out = torch.empty(*v.shape, dtype=torch.float64)
    state = state.clone()
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            for h in range(q.shape[2]):
                s = state[b, h] * decay[b, t, h].exp()
                s = s + torch.outer(k[b, t, h], beta[b, t, h] * (v[b, t, h] - k[b, t, h] @ s))
                state[b, h] = s
                out[b, t, h] = q[b, t, h] @ s
    return out, state


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_form_matches_float64_reference(chunk: int) -> None:
    inputs64 = _delta_rule_inputs(2, 300, 2, 8, 6, torch.float64)
    ref_out, ref_state = _reference(*inputs64)
    out, state = chunked_prefill(*_delta_rule_inputs(2, 300, 2, 8, 6, torch.float32), chunk=chunk)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-4)
    torch.testing.assert_close(state.double(), ref_state, rtol=0, atol=1e-4)


def test_recurrence_matches_float64_reference() -> None:
    ref_out, ref_state = _reference(*_delta_rule_inputs(2, 300, 2, 8, 6, torch.float64))
    q, k, v, decay, beta, state = _delta_rule_inputs(2, 300, 2, 8, 6, torch.float32)
    outs = []
    for t in range(q.shape[1]):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1).double(), ref_out, rtol=0, atol=1e-4)
    torch.testing.assert_close(state.double(), ref_state, rtol=0, atol=1e-4)


def test_chunked_form_leaves_padding_out_of_the_state() -> None:
    """A sequence padded with zero q/k/v, decay and beta ends in the state its real tokens leave."""
    q, k, v, decay, beta, state = _delta_rule_inputs(1, 40, 2, 8, 6, torch.float64)
    short = [t[:, :25] for t in (q, k, v, decay, beta)]
    padded = [torch.cat([t, torch.zeros_like(t[:, 25:])], dim=1) for t in short]
    out, final = chunked_prefill(*padded, state.clone(), chunk=16)
    ref_out, ref_state = _reference(*short, state)
    torch.testing.assert_close(out[:, :25], ref_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, ref_state, rtol=0, atol=1e-10)


@pytest.mark.parametrize("split", [1, 2, 5])
def test_conv_across_chunks_equals_one_pass(split: int) -> None:
    """The conv over a prompt equals the same prompt in two chunks (one shorter than the kernel's
    history) or as a chunk followed by single decode tokens: the conv state carries the window."""
    g = torch.Generator().manual_seed(1)
    channels, kernel, length = 6, 4, 9
    x = torch.randn(1, length, channels, generator=g, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=g, dtype=torch.float64)
    empty = torch.zeros(1, channels, kernel - 1, dtype=torch.float64)
    whole, _ = conv_prefill(x, empty, weight, torch.tensor([length]))
    first, state = conv_prefill(x[:, :split], empty, weight, torch.tensor([split]))
    rest, _ = conv_prefill(x[:, split:], state, weight, torch.tensor([length - split]))
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole)
    decoded = []
    for t in range(split, length):
        y, state = conv_decode(x[:, t], state, weight)
        decoded.append(y)
    torch.testing.assert_close(torch.stack(decoded, 1), whole[:, split:])
