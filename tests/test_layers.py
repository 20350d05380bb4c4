"""Layer-level checks against transformers' own functions."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from roseinfer.layers.linear import Linear
from roseinfer.layers.rotary import RotaryEmbedding, apply_rotary, interleave_rotary_rows


def random_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """roseinfer's Linear with nn.Linear's random values (it is built without any: a checkpoint sets them)."""
    layer = Linear(in_features, out_features, bias=bias)
    torch.nn.Linear.reset_parameters(layer)
    return layer


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_adjacent_pair_rotary_gives_hf_scores(heads: int, kv_heads: int) -> None:
    """Rows reordered at load + the complex rotation give the same q.k scores as HF's half-split
    rotary, and the same rotated vectors once the reordering is undone."""
    torch.manual_seed(0)
    tokens, head_dim, hidden = 7, 16, 32
    wq, wk = torch.randn(heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    x = torch.randn(tokens, hidden)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32) * 3 + 5, torch.rand(head_dim // 2))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    q_hf = (x @ wq.T).view(tokens, heads, head_dim).transpose(0, 1).unsqueeze(0)
    k_hf = (x @ wk.T).view(tokens, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, cos.unsqueeze(0), sin.unsqueeze(0))
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)  # [T, heads, D]

    rotations = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
    q = apply_rotary((x @ interleave_rotary_rows(wq, head_dim).T).view(tokens, heads, head_dim), rotations)
    k = apply_rotary((x @ interleave_rotary_rows(wk, head_dim).T).view(tokens, kv_heads, head_dim), rotations)

    group = heads // kv_heads
    scores_hf = torch.einsum("thd,shd->hts", q_hf, k_hf.repeat_interleave(group, dim=1))
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, dim=1))
    torch.testing.assert_close(scores, scores_hf, rtol=1e-5, atol=1e-4)
    # undo the reordering: [h, d/2, 2] -> [h, 2, d/2]
    unpaired = q.view(tokens, heads, head_dim // 2, 2).transpose(2, 3).reshape(tokens, heads, head_dim)
    torch.testing.assert_close(unpaired, q_hf, rtol=1e-5, atol=1e-5)


def test_partial_rotary_leaves_the_unrotated_dims_bit_for_bit_and_matches_phi3() -> None:
    """Phi-4-mini's 3/4 partial rotary: the leading 12 of 16 dims rotate (pairs reordered within
    them), the last 4 get rotation 1 + 0i and come out as they went in."""
    torch.manual_seed(0)
    tokens, heads, head_dim = 5, 2, 16
    config = {"model_type": "phi3", "partial_rotary_factor": 0.75, "rope_theta": 10000.0}
    table = RotaryEmbedding(head_dim, 64, config)
    positions = torch.tensor([0, 3, 9, 20, 63])
    rotations = table.lookup(positions)
    assert rotations.shape == (tokens, 1, head_dim // 2)
    assert torch.equal(rotations[:, :, 6:], torch.ones(tokens, 1, 2, dtype=torch.complex64))

    x_hf = torch.randn(tokens, heads, head_dim)
    x = interleave_rotary_rows(x_hf.permute(1, 2, 0).reshape(heads * head_dim, tokens), head_dim, 12)
    out = apply_rotary(x.view(heads, head_dim, tokens).permute(2, 0, 1).contiguous(), rotations)
    assert torch.equal(out[..., 12:], x_hf[..., 12:])  # the pass-through dims: untouched

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 12, 2).float() / 12))
    freqs = torch.outer(positions.float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    ref, _ = phi3_apply_rotary_pos_emb(x_hf.transpose(0, 1)[None], x_hf.transpose(0, 1)[None], cos[None], sin[None])
    ref = ref[0].transpose(0, 1)
    unpaired = out[..., :12].reshape(tokens, heads, 6, 2).transpose(2, 3).reshape(tokens, heads, 12)
    torch.testing.assert_close(unpaired, ref[..., :12], rtol=1e-6, atol=1e-6)


def test_interleave_rotary_rows_is_a_per_head_permutation() -> None:
    rows = torch.arange(2 * 8).float()  # two heads of head_dim 8, as a bias vector
    out = interleave_rotary_rows(rows, 8)
    assert out.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    weight = torch.arange(16 * 3).float().view(16, 3)
    assert torch.equal(interleave_rotary_rows(weight, 8)[:, 0], out * 3)
    # partial rotary: within each head only the first rotary_dims rows pair up
    assert interleave_rotary_rows(rows, 8, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 7, 8, 10, 9, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_llama_rms_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from roseinfer.layers.norm import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(96, 1e-5), LlamaRMSNorm(96, eps=1e-5)
    weight = torch.randn(96)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    for tokens in (1, 7, 300):
        x = (torch.randn(tokens, 96) * 3).to(dtype)
        assert torch.equal(ours(x), ref(x))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(bias: bool) -> None:
    from roseinfer.backends.cpu.layers import to_packed

    torch.manual_seed(0)
    layer = random_linear(48, 80, bias=bias)
    weight = layer.weight.detach().clone()
    with torch.inference_mode():
        inputs = [torch.randn(1, 48), torch.randn(37, 48), torch.randn(5, 100)[:, 10:58]]  # last: strided rows
        expected = [torch.nn.functional.linear(x, weight, layer.bias) for x in inputs]
        to_packed(layer)
        assert layer.weight is None and layer.packed is not None
        for x, ref in zip(inputs, expected):
            torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


def test_padded_rows_rounds_up_to_four_sizes_per_octave() -> None:
    from roseinfer.backends.cpu.layers import padded_rows

    sizes = [padded_rows(rows) for rows in range(1, 8193)]
    assert sizes[:8] == list(range(1, 9))  # small batches are never padded
    assert all(rows <= size <= 1.25 * rows for rows, size in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) == 48
    assert {padded_rows(n) for n in (16, 64, 256, 2048)} == {16, 64, 256, 2048}


def _onednn_row_counts(monkeypatch) -> list[int]:
    """The row count of every call that reaches oneDNN's matmul from now on, in order."""
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_prepacked_linear_runs_oneDNN_on_padded_row_counts_only(monkeypatch) -> None:
    """oneDNN caches one primitive per row count for the life of the process (backends/cpu/layers.py):
    1..300 rows must reach it as 29 padded sizes, and every output row stays exact."""
    from roseinfer.backends.cpu import ops
    from roseinfer.backends.cpu.layers import padded_rows, to_packed

    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 0)  # every row count to oneDNN, also on AVX-512
    torch.manual_seed(0)
    layer = random_linear(48, 80, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    seen = _onednn_row_counts(monkeypatch)
    with torch.inference_mode():
        to_packed(layer)
        for rows in range(1, 301):
            x = torch.randn(rows, 48)
            out = layer(x)
            assert out.shape == (rows, 80) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert set(seen) == {padded_rows(rows) for rows in range(1, 301)}
    assert len(set(seen)) == 29


def test_in_row_chunks_calls_fn_on_at_most_chunk_rows_rows() -> None:
    from roseinfer.layers import linear

    calls: list[int] = []

    def mlp(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.tanh(x) * 2

    for rows, pieces in ((1, [1]), (8, [8]), (21, [8, 8, 5])):
        calls.clear()
        x = torch.randn(rows, 6)
        assert torch.equal(linear.in_row_chunks(mlp, x, 8), torch.tanh(x) * 2)
        assert calls == pieces
    calls.clear()
    assert torch.equal(linear.in_row_chunks(mlp, x, None), torch.tanh(x) * 2) and calls == [21]


def _packed_matmul_available() -> bool:
    from roseinfer.backends.cpu import CPUBackend, onednn

    return onednn.available() and CPUBackend.supports(torch.device("cpu"), torch.float32)


needs_packed_matmul = pytest.mark.skipif(not _packed_matmul_available(), reason="needs oneDNN and the C kernels")


@needs_packed_matmul
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [80, 128, 200])  # 80 and 200 end in a partial 64-row block
def test_packed_linear_sends_decode_sized_batches_to_the_c_kernel(bias: bool, out_features: int, monkeypatch,
                                                                   packed_matmul_on_any_cpu) -> None:
    """With the C kernels on, up to PACKED_MATMUL_MAX_ROWS rows (here 14) are multiplied by
    csrc/packed_matmul.c straight from oneDNN's packed copy, in groups of 6 rows with a partial last
    one, strided rows included; more rows stay on oneDNN. Both agree with F.linear."""
    from roseinfer.backends.cpu import ops
    from roseinfer.backends.cpu.layers import padded_rows, to_packed

    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 14)
    torch.manual_seed(0)
    layer = random_linear(48, out_features, bias=bias)
    weight = layer.weight.detach().clone()
    seen = _onednn_row_counts(monkeypatch)
    with torch.inference_mode():
        to_packed(layer)
        if layer.packed_block != 64:
            pytest.skip(f"the kernel reads 64-row blocks; oneDNN packs {layer.packed_block}-row blocks here")
        assert layer.native_weights is not None
        for rows in (*range(1, 8), 12, 13, 14, 15):
            for x in (torch.randn(rows, 48), torch.randn(rows, 100)[:, 10:58]):
                out = layer(x)
                assert out.shape == (rows, out_features) and out.is_contiguous()
                torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen == [padded_rows(15)] * 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_packed_layout_is_verified_row_for_row(monkeypatch) -> None:
    """A [128, 48] weight fills the packed buffer exactly in blocks of 64, 32 or 1 rows, so only the
    comparison with the dense rows can tell which one oneDNN wrote; with none of them confirmed the
    layer keeps every row count on oneDNN."""
    from roseinfer.backends.cpu import onednn
    from roseinfer.backends.cpu.layers import to_packed

    weights = torch.randn(128, 48)
    packed = onednn.pack(weights)
    sizes = {b for b in (64, 32, 1) if onednn.packed_rows_view(packed, 128, 48, b) is not None}
    if onednn.packed_row_block(packed, weights) != 64 or sizes != {64, 32, 1}:
        pytest.skip("oneDNN does not pack this shape into 64-row blocks on this CPU")
    monkeypatch.setattr(onednn, "ROW_BLOCK_CANDIDATES", (32, 1, 64))
    assert onednn.packed_row_block(packed, weights) == 64
    monkeypatch.setattr(onednn, "ROW_BLOCK_CANDIDATES", (32, 1))
    assert onednn.packed_row_block(packed, weights) is None
    layer = Linear(48, 128, bias=False)
    with torch.inference_mode():
        layer.weight.copy_(weights)
        to_packed(layer)
        assert layer.packed_block is None and layer.native_weights is None
        torch.testing.assert_close(layer(torch.ones(1, 48)), weights.sum(1)[None], rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
@pytest.mark.parametrize("flags, used", [("flags : fpu sse2 avx avx2 fma", True), ("flags : fpu avx2 fma avx512f", True),
                                         ("flags : fpu sse2 avx", False), ("Features : fp asimd evtstrm", False)])
def test_packed_matmul_kernel_runs_where_its_tiles_were_measured(monkeypatch, flags: str, used: bool) -> None:
    """AVX-512 and AVX2 (with FMA) have tilings of their own in csrc/packed_matmul.c; other CPUs,
    Arm among them, keep oneDNN (with 64-row packing where the kernel could read it at all)."""
    from roseinfer.backends.cpu import ops
    from roseinfer.backends.cpu.layers import to_packed

    monkeypatch.setattr(ops, "cpu_flags", lambda: flags)
    ops.packed_matmul_suits_cpu.cache_clear()
    try:
        layer = to_packed(random_linear(48, 128, bias=False))
        if layer.packed_block != ops.PACKED_MATMUL_BLOCK:
            pytest.skip(f"oneDNN packs in blocks of {layer.packed_block} rows on this CPU")
        assert (layer.native_weights is not None) == used
    finally:
        ops.packed_matmul_suits_cpu.cache_clear()


def _native_linear(in_features: int, out_features: int, bias: bool):
    """A Linear whose decode-sized batches run in csrc/packed_matmul.c, or a skip where they cannot."""
    from roseinfer.backends.cpu.layers import to_packed

    layer = to_packed(random_linear(in_features, out_features, bias=bias))
    if layer.native_weights is None:
        pytest.skip(f"the kernel reads 64-row blocks; oneDNN packs {layer.packed_block}-row blocks here")
    return layer


@needs_packed_matmul
@pytest.mark.parametrize("bias", [False, True])
def test_norm_and_activation_folded_into_the_c_matmul_give_the_separate_calls_bits(bias: bool, monkeypatch,
                                                                                    packed_matmul_on_any_cpu) -> None:
    """forward_normed (RMSNorm with the residual add, then the matmul) and forward_activated
    (SiLU * up, then the matmul) are one C call each up to PACKED_MATMUL_MAX_ROWS rows: output and
    residual stream bit for bit what the norm, the activation and the matmul give as separate calls,
    strided rows, partial row groups and a partial last weight block (200 outputs) included. Above
    the limit they fall back to those calls."""
    from roseinfer.backends.cpu import ops
    from roseinfer.backends.cpu.layers import NativeRMSNorm, NativeSiluAndMul

    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 14)
    torch.manual_seed(0)
    layer, down = _native_linear(96, 200, bias), _native_linear(48, 96, bias)
    norm, act = NativeRMSNorm(96, 1e-5), NativeSiluAndMul("silu")
    norm.weight.data.uniform_(0.5, 1.5)
    fused = {name: 0 for name in ("rms_norm_packed_matmul", "silu_mul_packed_matmul")}
    for name in fused:
        real = getattr(ops, name)

        def counted(*args, _real=real, _name=name):
            fused[_name] += 1
            return _real(*args)

        monkeypatch.setattr(ops, name, counted)
    with torch.inference_mode():
        for rows in (1, 5, 6, 7, 13, 14, 15):
            for x in (torch.randn(rows, 96), torch.randn(rows, 130)[:, 20:116]):
                residual = torch.randn(rows, 96)
                out, stream = layer.forward_normed(x, norm, residual.clone())
                expected_h, expected_stream = norm.forward(x, residual.clone())
                assert torch.equal(out, layer.forward(expected_h)) and torch.equal(stream, expected_stream)
                out, stream = layer.forward_normed(x, norm, None)
                assert torch.equal(out, layer.forward(norm.forward(x))) and stream is x
            gate_up = torch.randn(rows, 96) * 4
            assert torch.equal(down.forward_activated(gate_up, act), down.forward(act.forward(gate_up)))
    assert fused == {"rms_norm_packed_matmul": 24, "silu_mul_packed_matmul": 6}  # 15 rows: not fused
