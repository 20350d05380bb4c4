"""The gated delta rule's C kernels (csrc/gated_delta_rule.c) as torch functions, on the linear
attention's state pool in place."""
from __future__ import annotations

import torch

from roseinfer.backends.cpu.kernels import native_library
from roseinfer.backends.cpu.ops import check_dense


def gated_delta_decode_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The gated delta rule's decode step (layers/gated_delta_rule.py recurrent_step) on the state pool
    in place: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H], states [slots, H, Dk, Dv] (contiguous),
    sequence i's at slots[i], zeroed first where keep[i] is 0. Returns o [n, H, Dv]."""
    if not states.is_contiguous():
        raise ValueError("gated_delta_decode_ updates the state pool in place and needs it contiguous")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots, keep = slots.contiguous(), keep.float().contiguous()
    check_dense(torch.int64, slots=slots)
    n, heads, k_dim = k.shape
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float32)
    native_library().gated_delta_decode_f32(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), g=g.data_ptr(),
                                            beta=beta.data_ptr(), states=states.data_ptr(), slots=slots.data_ptr(),
                                            keep=keep.data_ptr(), out=out.data_ptr(), n=n, heads=heads,
                                            k_dim=k_dim, v_dim=v.shape[-1], num_threads=torch.get_num_threads())
    return out


def gated_delta_prefill_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                         lens: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over sequences of several tokens (layers/gated_delta_rule.py chunked_prefill,
    token by token) on the state pool in place: q, k [n, L, H, Dk], v [n, L, H, Dv], g, beta [n, L, H]
    right-padded, sequence i's first lens[i] tokens continuing states[slots[i]] (zeroed first where
    keep[i] is 0). Returns o [n, L, H, Dv], its padding rows unwritten."""
    if not states.is_contiguous():
        raise ValueError("gated_delta_prefill_ updates the state pool in place and needs it contiguous")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots, keep, lens = slots.contiguous(), keep.float().contiguous(), lens.contiguous()
    check_dense(torch.int64, slots=slots, lens=lens)
    n, length, heads, k_dim = k.shape
    out = torch.empty(n, length, heads, v.shape[-1], dtype=torch.float32)
    native_library().gated_delta_prefill_f32(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), g=g.data_ptr(),
                                             beta=beta.data_ptr(), states=states.data_ptr(), slots=slots.data_ptr(),
                                             keep=keep.data_ptr(), lens=lens.data_ptr(), out=out.data_ptr(), n=n,
                                             length=length, heads=heads, k_dim=k_dim, v_dim=v.shape[-1],
                                             num_threads=torch.get_num_threads())
    return out
