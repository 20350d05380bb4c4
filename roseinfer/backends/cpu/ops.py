"""The C kernels as torch functions: CPU fp32 tensors in, tensors out (csrc/kernels.h documents each
kernel; the arguments below are passed by the names it gives them)."""
from __future__ import annotations

import ctypes
import functools

import torch

from roseinfer.backends.cpu.kernels import cpu_flags, native_library

PREFILL_LANES = 64  # LANES in csrc/prefill_attention.c: query vectors one task holds side by side
# Above it oneDNN's blocked GEMM is as fast or faster (backends/cpu/layers.py): at 256 rows with
# AVX-512's tiles, at 16 with AVX2's (fewer rows per weight read; docs/profiling.md).
PACKED_MATMUL_MAX_ROWS = 256 if "avx512f" in cpu_flags().split() else 16
PACKED_MATMUL_BLOCK = 64  # BLOCK in csrc/packed_matmul.c: the row-block size of the packed layout it reads


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with contiguous rows (last dims dense), whatever the stride between rows. Checked on the
    strides: indexing a row to ask it took 2 us, a quarter of a small kernel's whole call."""
    dense = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != dense:
            return t.contiguous()
        dense *= size
    return t


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def check_dense(dtype: torch.dtype, rows: dict[str, torch.Tensor] | None = None, **dense: torch.Tensor | None) -> None:
    """The kernels read `dense` as dense arrays of dtype and `rows` as rows of dtype (any stride between
    rows): another dtype or a strided view would send them past the tensor's memory."""
    for name, t in (rows or {}).items():
        if t.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor, got a {t.dtype} one")
    for name, t in dense.items():
        if t is not None and (t.dtype != dtype or not t.is_contiguous()):
            layout = "" if t.is_contiguous() else " strided"
            raise TypeError(f"{name} must be a contiguous {dtype} tensor, got a{layout} {t.dtype} one")


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read one fp32 per query head, contiguous."""
    return None if sinks is None else sinks.detach().float().contiguous()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           kv_lens: torch.Tensor, block_size: int, scale: float, sliding_window: int | None = None,
                           logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, H, D], one query per sequence; caches: [slots, Hkv, D]; block_tables: [n, max_blocks];
    kv_lens: [n] tokens of each query's context, of which it attends to the last sliding_window (all
    where None); logit_softcap and sinks ([H] fp32) as PagedAttention's. Returns [n, H, D]."""
    q = _rows(q)
    n, num_heads, head_dim = q.shape
    out = _decode_attention(q, None, None, k_cache, v_cache, block_tables, kv_lens, block_size, num_heads, scale,
                            sliding_window, logit_softcap, sinks)
    return out.view(n, num_heads, head_dim)


def decode_attention_qkv(qkv: torch.Tensor, rotations: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                         num_heads: int, scale: float, sliding_window: int | None = None,
                         logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary on q and k, the KV write and decode attention in one call, for a batch where every row
    decodes. qkv: the projection's output [n, (H + 2 * Hkv) * D], rotated in place (where its rows
    are dense; otherwise a dense copy is); rotations: [n, 1, D / 2] complex64 (layers/rotary.py);
    slots: [n] cache slot of each new token. Returns [n, H * D]: exactly what rotary_, store_kv and
    paged_decode_attention give one after another."""
    angles = torch.view_as_real(rotations).contiguous()
    return _decode_attention(_rows(qkv), angles, slots, k_cache, v_cache, block_tables, kv_lens, block_size,
                             num_heads, scale, sliding_window, logit_softcap, sinks)


def _decode_attention(q_rows: torch.Tensor, angles: torch.Tensor | None, slots: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                      block_size: int, num_heads: int, scale: float, sliding_window: int | None,
                      logit_softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The kernel over q_rows [n, ...] whose first H * D floats per row are the query; with angles
    and slots, the row is a whole qkv row, rotated and stored first. Returns [n, H * D]."""
    check_dense(torch.int64, block_tables=block_tables, kv_lens=kv_lens, slots=slots)
    check_dense(torch.float32, {"q": q_rows}, k_cache=k_cache, v_cache=v_cache)
    n, num_kv_heads, head_dim = q_rows.shape[0], k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(n, num_heads * head_dim, dtype=q_rows.dtype)
    sink_rows = _sinks(sinks)
    failed = native_library().paged_decode_attention_f32(
        q=q_rows.data_ptr(), q_row_stride=q_rows.stride(0), rope=_address(angles), new_slots=_address(slots),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), out=out.data_ptr(),
        block_tables=block_tables.data_ptr(), kv_lens=kv_lens.data_ptr(), n=n, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, max_blocks=block_tables.shape[1],
        scale=scale, sliding_window=sliding_window or 0, logit_softcap=logit_softcap or 0.0,
        sinks=_address(sink_rows), num_threads=torch.get_num_threads())
    if failed:
        raise MemoryError("paged attention could not allocate its scratch buffers")
    return out


def prefill_attention_supported(head_dim: int, group: int) -> bool:
    """paged_prefill_attention's vector loops take head dims that are whole 16-float chunks, up to 128,
    and a task holds at least one query row: the `group` query heads sharing a KV head fit its lanes."""
    return head_dim % 16 == 0 and head_dim <= 128 and group <= PREFILL_LANES


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                            scale: float, out: torch.Tensor, sliding_window: int | None = None,
                            logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Causal attention for prompt chunks: sequence i's queries are rows q_starts[i] .. + q_lens[i] - 1
    of q [rows, H, D], at the last q_lens[i] of its kv_lens[i] cached positions (this chunk's K/V
    already written), within sliding_window (as paged_decode_attention's). Writes those rows of out [rows, H, D] (contiguous); other rows are left alone."""
    q = _rows(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    if not prefill_attention_supported(head_dim, group) or not out.is_contiguous():
        raise ValueError(f"paged_prefill_attention needs a head dim that is a multiple of 16 up to 128 "
                         f"(got {head_dim}), at most {PREFILL_LANES} query heads per KV head (got {group}) "
                         f"and a contiguous out")
    check_dense(torch.int64, block_tables=block_tables, q_starts=q_starts, q_lens=q_lens, kv_lens=kv_lens)
    check_dense(torch.float32, {"q": q, "out": out}, k_cache=k_cache, v_cache=v_cache)  # out: contiguous above
    sink_rows = _sinks(sinks)
    failed = native_library().paged_prefill_attention_f32(
        q=q.data_ptr(), q_row_stride=q.stride(0), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        out=out.data_ptr(), block_tables=block_tables.data_ptr(), q_starts=q_starts.data_ptr(),
        q_lens=q_lens.data_ptr(), kv_lens=kv_lens.data_ptr(), n=q_lens.shape[0], num_heads=num_heads,
        num_kv_heads=k_cache.shape[1], head_dim=head_dim, block_size=block_size, max_blocks=block_tables.shape[1],
        scale=scale, sliding_window=sliding_window or 0, logit_softcap=logit_softcap or 0.0,
        sinks=_address(sink_rows), num_threads=torch.get_num_threads())
    if failed:
        raise MemoryError("prefill attention could not allocate its scratch buffers")


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v; k, v: [n, Hkv, D]."""
    k, v = _rows(k), _rows(v)
    check_dense(torch.int64, slots=slots)
    check_dense(torch.float32, {"k": k, "v": v}, k_cache=k_cache, v_cache=v_cache)
    native_library().store_kv_f32(k=k.data_ptr(), k_row_stride=k.stride(0), v=v.data_ptr(), v_row_stride=v.stride(0),
                                  slots=slots.data_ptr(), n=k.shape[0], row_floats=k[0].numel() if k.shape[0] else 0,
                                  k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [n, dim]; with `residual` (contiguous [n, dim]), residual += x
    first, in place, and the sum is what gets normalised."""
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm's residual is updated in place and must be contiguous")
    x = _rows(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # 1 us; torch.empty(x.shape, ...) took 3
    native_library().rms_norm_f32(x=x.data_ptr(), x_row_stride=x.stride(0), residual=_address(residual),
                                  weight=weight.data_ptr(), out=out.data_ptr(), n=x.shape[0], dim=x.shape[1], eps=eps,
                                  num_threads=torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [n, 2 * width] (contiguous) -> [n, width]."""
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # kept in a name: a temporary would be freed before the call reads it
    out = torch.empty(n, width, dtype=gate_up.dtype)
    native_library().silu_mul_f32(gate_up=gate_up.data_ptr(), out=out.data_ptr(), n=n, width=width,
                                  num_threads=torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotates x [n, heads, head_dim] (heads contiguous; rows may be strided) in place by
    rotations [n, 1, head_dim / 2] complex64 (layers/rotary.py); returns x."""
    if _rows(x) is not x:  # rotated where it lies, so it cannot be copied into shape
        raise ValueError("rotary_ needs each row's heads contiguous")
    angles = torch.view_as_real(rotations).contiguous()
    native_library().rotary_f32(x=x.data_ptr(), x_row_stride=x.stride(0), rope=angles.data_ptr(), n=x.shape[0],
                                heads=x.shape[1], head_dim=x.shape[2], num_threads=torch.get_num_threads())
    return x


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for contiguous fp32 x [n, width]: ties and NaNs resolved the same way."""
    x = x.contiguous()
    check_dense(torch.float32, x=x)
    out = torch.empty(x.shape[0], dtype=torch.long)
    native_library().argmax_rows_f32(x=x.data_ptr(), n=x.shape[0], width=x.shape[1], out=out.data_ptr(),
                                     num_threads=torch.get_num_threads())
    return out


@functools.cache
def packed_matmul_suits_cpu() -> bool:
    """The kernel's tiles are sized for AVX-512's and AVX2's register files (csrc/packed_matmul.c),
    where it was measured; other CPUs (Arm among them: not measured) keep oneDNN."""
    flags = cpu_flags().split()
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


def packed_matmul(x: torch.Tensor, packed_ptr: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias), where W [out_features, k] is packed at packed_ptr in 64-row blocks
    (backends/cpu/onednn.py checks that layout). Returns [m, out_features]."""
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    native_library().packed_matmul_f32(x=x.data_ptr(), x_stride=x.stride(0), packed=packed_ptr, bias=_address(bias),
                                       out=out.data_ptr(), m=m, n=out_features, k=k,
                                       num_threads=torch.get_num_threads())
    return out


def rms_norm_packed_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                           packed_ptr: int, weight_type: int, out_features: int, bias: torch.Tensor | None
                           ) -> torch.Tensor:
    """packed_matmul(rms_norm(x, norm_weight, eps, residual), ...) in one call, with the same results
    (residual, when given, updated in place the same way). weight_type 0: the weight at packed_ptr is
    packed fp32; else it is GGUF blocks of that GGML type (quant_matmul's results)."""
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm_packed_matmul's residual is updated in place and must be contiguous")
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    failed = native_library().rms_norm_packed_matmul_f32(
        x=x.data_ptr(), x_stride=x.stride(0), residual=_address(residual), norm_weight=norm_weight.data_ptr(), eps=eps,
        packed=packed_ptr, weight_type=weight_type, bias=_address(bias), out=out.data_ptr(), m=m, n=out_features, k=k,
        num_threads=torch.get_num_threads())
    if failed:
        raise MemoryError("rms_norm_packed_matmul could not allocate the normalised rows (or the weight type "
                          "does not fit the width)")
    return out


def silu_mul_packed_matmul(gate_up: torch.Tensor, packed_ptr: int, weight_type: int, out_features: int,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """packed_matmul(silu_mul(gate_up), ...) in one call, with the same results (weight_type as
    rms_norm_packed_matmul takes it)."""
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # kept in a name: a temporary would be freed before the call reads it
    out = torch.empty(m, out_features, dtype=gate_up.dtype)
    failed = native_library().silu_mul_packed_matmul_f32(
        gate_up=gate_up.data_ptr(), packed=packed_ptr, weight_type=weight_type, bias=_address(bias),
        out=out.data_ptr(), m=m, n=out_features, k=k, num_threads=torch.get_num_threads())
    if failed:
        raise MemoryError("silu_mul_packed_matmul could not allocate the activation (or the weight type does not "
                          "fit the width)")
    return out


def decode_layer_struct() -> type[ctypes.Structure]:
    """decode_layer_t of csrc/kernels.h: a decoder layer's norm weights, packed matmul weights (64-row
    blocks) and biases (NULL for none), and its K/V cache."""
    return native_library().structs["decode_layer_t"]


def decode_layers(layers: ctypes.Array, x: torch.Tensor, rotations: torch.Tensor, slots: torch.Tensor,
                  block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float) -> torch.Tensor:
    """Every decoder layer of a decode step where each row decodes, in one call: the results of
    norm + q/k/v, decode_attention_qkv, o_proj, norm + gate/up and SiLU + down layer after layer.
    x: the embeddings [n, hidden], contiguous; it becomes the residual stream, updated in place.
    Returns the last layer's MLP output [n, hidden]."""
    if not x.is_contiguous():
        raise ValueError("decode_layers updates x in place and needs it contiguous")
    n, hidden = x.shape
    angles = torch.view_as_real(rotations).contiguous()
    out = torch.empty_like(x)
    failed = native_library().decode_layers_f32(
        layers=ctypes.addressof(layers), num_layers=len(layers), x=x.data_ptr(), out=out.data_ptr(),
        rope=angles.data_ptr(), new_slots=slots.data_ptr(), block_tables=block_tables.data_ptr(),
        kv_lens=kv_lens.data_ptr(), n=n, hidden=hidden, intermediate=intermediate, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, max_blocks=block_tables.shape[1],
        eps=eps, scale=scale, num_threads=torch.get_num_threads())
    if failed:
        raise MemoryError("decode_layers could not allocate its buffers")
    return out


def packed_matmul_steps(weights: list[tuple[int, int, torch.Tensor | None, int, int]], x: torch.Tensor,
                        steps: int) -> None:
    """`steps` times, x's rows times every weight (address, layout type, bias, out_features,
    in_features; type 0 packed fp32, else the GGML type of GGUF blocks) in turn, all in one call: the
    matmul floor of a decode step that runs in C (decode_layers)."""
    count = len(weights)
    pointers = ctypes.c_void_p * count
    sizes = ctypes.c_int64 * count
    x = _rows(x)
    if any(in_features > x.shape[1] for *_, in_features in weights):
        raise ValueError("packed_matmul_steps needs x as wide as the widest input")
    out = torch.empty(x.shape[0], max(w[3] for w in weights), dtype=x.dtype)
    failed = native_library().packed_matmul_steps_f32(
        packed=pointers(*(w[0] for w in weights)), types=sizes(*(w[1] for w in weights)),
        bias=pointers(*(_address(w[2]) for w in weights)), n=sizes(*(w[3] for w in weights)),
        k=sizes(*(w[4] for w in weights)), count=count, x=x.data_ptr(), x_stride=x.stride(0), out=out.data_ptr(),
        m=x.shape[0], steps=steps, num_threads=torch.get_num_threads())
    if failed:
        raise ValueError("packed_matmul_steps: a quantized weight's GGML type or width is not supported")


def weight_part_struct() -> type[ctypes.Structure]:
    """weight_part_t of csrc/kernels.h: one part of a weight whose output rows are stored in several
    GGML types (its blocks' address, its type, its rows)."""
    return native_library().structs["weight_part_t"]


def weight_matmul(x: torch.Tensor, weight_ptr: int, weight_type: int, out_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias) with W in any layout the C matmuls read (weight_type 0 packed fp32,
    -count an array of weight_part_t at weight_ptr, else GGUF blocks of that GGML type)."""
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    failed = native_library().weight_matmul_f32(
        x=x.data_ptr(), x_stride=x.stride(0), weight=weight_ptr, weight_type=weight_type, bias=_address(bias),
        out=out.data_ptr(), m=m, n=out_features, k=k, num_threads=torch.get_num_threads())
    if failed:
        raise ValueError(f"weight_matmul: layout {weight_type} with rows of {k} weights into {out_features} "
                         "outputs is not supported, or its buffers could not be allocated")
    return out


def quant_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias), W [n, k] kept as GGUF blocks: weight is uint8 [n, bytes per row]
    (csrc/quants.h), qtype its GGML type id. Returns [m, n] (fp32 sums)."""
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, weight.shape[0], dtype=x.dtype)
    failed = native_library().quant_matmul_f32(
        x=x.data_ptr(), x_stride=x.stride(0), weight=weight.data_ptr(), type=qtype, bias=_address(bias),
        out=out.data_ptr(), m=m, n=weight.shape[0], k=k, num_threads=torch.get_num_threads())
    if failed:
        raise ValueError(f"quant_matmul: GGML type {qtype} with rows of {k} weights is not supported")
    return out


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts in one call: x [T, H], routing weights (fp32) and
    expert ids (int64) [T, k] -> sum over each token's experts of weight * down(silu(gate) * up) [T, H].
    gate_up [E, 2 w, bytes] and down [E, H, bytes] are GGUF blocks (their `ggml_type` on them)."""
    x = _rows(x)
    weights, experts = weights.to(torch.float32).contiguous(), experts.to(torch.int64).contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    failed = native_library().moe_experts_f32(
        x=x.data_ptr(), x_stride=x.stride(0), experts=experts.data_ptr(), weights=weights.data_ptr(),
        tokens=experts.shape[0], top_k=experts.shape[1], gate_up=gate_up.data_ptr(), gate_up_type=gate_up.ggml_type,
        down=down.data_ptr(), down_type=down.ggml_type, num_experts=gate_up.shape[0], hidden=x.shape[1],
        width=gate_up.shape[1] // 2, out=out.data_ptr(), num_threads=torch.get_num_threads())
    if failed:
        raise ValueError(f"moe_experts: GGML types {int(gate_up.ggml_type)}/{int(down.ggml_type)} with {x.shape[1]} "
                         f"and {gate_up.shape[1] // 2} weights a row, an expert id outside {gate_up.shape[0]} "
                         "experts, or buffers that could not be allocated")
    return out


def repack_for_int8_gemm(weight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """A Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1 weight (uint8 [n, bytes per row], k weights a row) in
    csrc/q8_gemm.c's tiles of 16 rows, a flat uint8 tensor: the layout weight type qtype | INT8_ACTIVATIONS | INT8_REPACKED reads."""
    library, n, weight = native_library(), weight.shape[0], weight.contiguous()
    out = torch.empty(library.q8_repacked_bytes(type=qtype, n=n, k=k), dtype=torch.uint8)
    if library.q8_repack(weight=weight.data_ptr(), type=qtype, n=n, k=k, out=out.data_ptr(),
                         num_threads=torch.get_num_threads()):
        raise ValueError(f"repack_for_int8_gemm: GGML type {qtype} with rows of {k} weights is not supported")
    return out


def dequantize_rows(weight: torch.Tensor, qtype: int, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` (int64) of the quantized table weight (uint8 [rows, bytes per row], GGML type
    qtype, k weights a row), dequantized: [len(ids), k] fp32."""
    ids = ids.contiguous()
    check_dense(torch.int64, ids=ids)
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    failed = native_library().dequantize_rows_f32(
        weight=weight.data_ptr(), type=qtype, ids=ids.data_ptr(), count=ids.numel(), k=k, out=out.data_ptr(),
        num_threads=torch.get_num_threads())
    if failed:
        raise ValueError(f"dequantize_rows: GGML type {qtype} with rows of {k} weights is not supported")
    return out
