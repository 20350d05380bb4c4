"""The Triton gated delta rule (roseinfer/backends/triton/delta_rule.py) against the float64 reference
written token by token (tests/test_gated_delta_rule.py): long odd-length sequences with padding, fresh
and carried state, decode steps, all in place on a state pool whose other slots stay untouched.
Without a CUDA device it runs on CPU tensors in Triton's interpreter (tests/triton_interpret.py)."""
from __future__ import annotations

import pytest
import torch

import triton_interpret

pytest.importorskip("triton")
triton_interpret.patch_interpreter()

from roseinfer.backends.triton.delta_rule import gated_delta_rule_  # noqa: E402
from test_gated_delta_rule import _delta_rule_inputs, _reference  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = triton_interpret.device()
HEADS, K_DIM, V_DIM = 2, 8, 40  # Dk padded to the kernel's 16 rows; Dv one whole tile of 32 and a part one


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float().to(DEVICE) for t in tensors]


def _pool_with(states: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of 5 random slots with `states` at `slots`, and a copy of it to check the others against."""
    pool = torch.randn(5, HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(7))
    pool[slots] = states.float()
    return pool.to(DEVICE), pool.clone()


def test_prefill_matches_float64_reference_over_padded_sequences() -> None:
    """Three sequences of 301, 170 and 1 tokens, right-padded with noise the kernel must not read; the
    second starts from zeros (keep 0) whatever its slot holds."""
    lens, keep, slots = [301, 170, 1], [1.0, 0.0, 1.0], torch.tensor([3, 1, 0])
    inputs64 = _delta_rule_inputs(3, 301, HEADS, K_DIM, V_DIM, torch.float64)
    pool, before = _pool_with(inputs64[5], slots)
    out = gated_delta_rule_(*_on_device(*inputs64[:5]), pool, slots.to(DEVICE), torch.tensor(keep, device=DEVICE),
                            torch.tensor(lens, device=DEVICE)).cpu()
    pool = pool.cpu()
    for i, (n, kept) in enumerate(zip(lens, keep)):
        ref_out, ref_state = _reference(*(t[i:i + 1, :n] for t in inputs64[:5]), inputs64[5][i:i + 1] * kept)
        torch.testing.assert_close(out[i:i + 1, :n].double(), ref_out, rtol=0, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]].double(), ref_state[0], rtol=0, atol=1e-4)
    assert torch.equal(pool[[2, 4]], before[[2, 4]])


def test_chunks_then_decodes_carry_the_state() -> None:
    """A sequence of 223 tokens as a fresh chunk of 150 (its slot holding another request's state), a
    carried chunk of 61 and 12 decode steps equals the float64 recurrence over all of it from zeros.
    The decode steps read v as a strided view, as the model hands it (a slice of the conv's output)."""
    q, k, v, g, beta, _ = _delta_rule_inputs(1, 223, HEADS, K_DIM, V_DIM, torch.float64)
    ref_out, ref_state = _reference(q, k, v, g, beta, torch.zeros(1, HEADS, K_DIM, V_DIM, dtype=torch.float64))
    slots = torch.tensor([2], device=DEVICE)
    pool, before = _pool_with(torch.randn(1, HEADS, K_DIM, V_DIM), torch.tensor([2]))
    outs = []
    for start, end, kept in ((0, 150, 0.0), (150, 211, 1.0)):
        chunk = _on_device(*(t[:, start:end] for t in (q, k, v, g, beta)))
        outs.append(gated_delta_rule_(*chunk, pool, slots, torch.tensor([kept], device=DEVICE),
                                      torch.tensor([end - start], device=DEVICE)))
    for t in range(211, 223):
        q1, k1, g1, beta1 = _on_device(*(x[:, t:t + 1] for x in (q, k, g, beta)))
        wide = torch.cat([torch.randn(1, 1, HEADS, 3), v[:, t:t + 1].float()], dim=-1).to(DEVICE)
        outs.append(gated_delta_rule_(q1, k1, wide[..., 3:], g1, beta1, pool, slots, torch.ones(1, device=DEVICE)))
    torch.testing.assert_close(torch.cat(outs, dim=1).cpu().double(), ref_out, rtol=0, atol=1e-4)
    pool = pool.cpu()
    torch.testing.assert_close(pool[2].double(), ref_state[0], rtol=0, atol=1e-4)
    assert torch.equal(pool[[0, 1, 3, 4]], before[[0, 1, 3, 4]])


def test_decode_batch_through_the_metadata_interface() -> None:
    """TritonMetadata.delta_rule_decode, as the model calls it ([n, H, D] rows, one token each): two
    sequences, one continuing its slot and one starting fresh, equal AttentionMetadata's torch step."""
    from roseinfer.backends.triton import TritonMetadata
    from roseinfer.layers.attention import AttentionMetadata

    inputs = _delta_rule_inputs(2, 1, HEADS, K_DIM, V_DIM, torch.float32)
    q, k, v, g, beta = (t[:, 0] for t in inputs[:5])
    states = inputs[5]
    slots, keep = torch.tensor([4, 0]), torch.tensor([1.0, 0.0])
    pool, _ = _pool_with(states, slots)
    reference_pool = pool.cpu().clone()
    expected = AttentionMetadata.delta_rule_decode(None, q, k, v, g, beta, reference_pool, slots, keep)
    meta = TritonMetadata(torch.zeros(2, dtype=torch.long), 16, None, None)
    out = meta.delta_rule_decode(*_on_device(q, k, v, g, beta), pool, slots.to(DEVICE), keep.to(DEVICE))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.cpu(), reference_pool, rtol=1e-5, atol=1e-5)
