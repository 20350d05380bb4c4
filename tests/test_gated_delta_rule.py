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


def test_cpu_decode_kernel_matches_float64_reference() -> None:
    """The CPU backend's C decode step (csrc/gated_delta_rule.c), in place on a pool: 300 tokens from
    two slots of five equal the float64 recurrence; the other slots stay as they were; a sequence
    whose keep is 0 starts from zeros whatever its slot holds."""
    from roseinfer.backends.cpu import delta_rule_ops
    from roseinfer.backends.cpu.kernels import kernels_available

    if not kernels_available():
        pytest.skip("the C kernels cannot be built here")
    ref_out, ref_state = _reference(*_delta_rule_inputs(2, 300, 2, 8, 6, torch.float64))
    q, k, v, decay, beta, state = _delta_rule_inputs(2, 300, 2, 8, 6, torch.float32)
    slots = torch.tensor([3, 1])
    pool = torch.randn(5, 2, 8, 6)
    untouched = pool.clone()
    pool[slots] = state
    outs = [delta_rule_ops.gated_delta_decode_(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], pool, slots,
                                               torch.ones(2))
            for t in range(q.shape[1])]
    torch.testing.assert_close(torch.stack(outs, 1).double(), ref_out, rtol=0, atol=1e-4)
    torch.testing.assert_close(pool[slots].double(), ref_state, rtol=0, atol=1e-4)
    assert torch.equal(pool[[0, 2, 4]], untouched[[0, 2, 4]])
    fresh_out, fresh_state = _reference(*(t[:1, :1] for t in _delta_rule_inputs(1, 1, 2, 8, 6, torch.float64)[:5]),
                                        torch.zeros(1, 2, 8, 6, dtype=torch.float64))
    q1, k1, v1, decay1, beta1, _ = _delta_rule_inputs(1, 1, 2, 8, 6, torch.float32)
    out = delta_rule_ops.gated_delta_decode_(q1[:, 0], k1[:, 0], v1[:, 0], decay1[:, 0], beta1[:, 0], pool,
                                             slots[:1], torch.zeros(1))
    torch.testing.assert_close(out.double(), fresh_out[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(pool[3:4].double(), fresh_state, rtol=0, atol=1e-5)


def test_cpu_prefill_kernel_matches_float64_reference() -> None:
    """The CPU backend's C prefill (csrc/gated_delta_rule.c), in place on a pool: three right-padded
    sequences of 300, 170 and 1 tokens (values of 20 columns: a full slab of 16 and a part one) equal
    the float64 recurrence over their own tokens, whatever the padding holds; the second starts from
    zeros (keep 0) whatever its slot holds; the pool's other slots stay as they were."""
    from roseinfer.backends.cpu import delta_rule_ops
    from roseinfer.backends.cpu.kernels import kernels_available

    if not kernels_available():
        pytest.skip("the C kernels cannot be built here")
    lens, keep, slots = [300, 170, 1], [1.0, 0.0, 1.0], torch.tensor([3, 1, 0])
    inputs64 = _delta_rule_inputs(3, 300, 2, 8, 20, torch.float64)
    pool = torch.randn(5, 2, 8, 20)
    untouched = pool.clone()
    pool[slots] = inputs64[5].float()
    out = delta_rule_ops.gated_delta_prefill_(*(t.float() for t in inputs64[:5]), pool, slots,
                                              torch.tensor(keep), torch.tensor(lens))
    for i, (n, kept) in enumerate(zip(lens, keep)):
        start = inputs64[5][i:i + 1] * kept
        ref_out, ref_state = _reference(*(t[i:i + 1, :n] for t in inputs64[:5]), start)
        torch.testing.assert_close(out[i:i + 1, :n].double(), ref_out, rtol=0, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]].double(), ref_state[0], rtol=0, atol=1e-4)
    assert torch.equal(pool[[2, 4]], untouched[[2, 4]])
