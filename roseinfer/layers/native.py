"""roseinfer's C kernels (layers/csrc): compiled once per machine, called through ctypes.

Stock PyTorch has no CPU kernel that reads a paged KV cache in place, and on small decode batches
its chains of elementwise ops cost more in dispatch than in arithmetic. The few hot spots that
need it are a page of plain C with OpenMP each, not a torch extension: they compile in about a
second with the system C compiler (no torch headers, no pybind), and ctypes drops the GIL for the
call. `-fopenmp` links libgomp by its soname, which resolves to the copy torch has already loaded,
so the kernels share torch's OpenMP threads instead of starting a second pool.

Only CPU fp32 tensors go through here (`native_kernels_available` says whether they can); the
layers keep their torch path for everything else.

The shared library is cached under $ROSEINFER_CACHE_DIR (default ~/.cache/roseinfer), keyed by
the sources, the compiler and this CPU's feature flags, because it is built with -march=native.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

CSRC = pathlib.Path(__file__).with_name("csrc")
# ISO C mode (-std=c11) turns floating-point contraction off, so every a * b + c in the vector loops
# was a multiply and an add: -ffp-contract=fast lets them be one FMA (prefill attention 5-8 % faster).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast")


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here; the message says why."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeKernelsUnavailable("no C compiler found (set CC, or install gcc)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _cache_dir() -> pathlib.Path:
    """$ROSEINFER_CACHE_DIR/kernels as given; otherwise ~/.cache (or $XDG_CACHE_HOME)/roseinfer/kernels,
    or a per-user folder in the temp dir where the home folder cannot be written (read-only CI homes)."""
    if os.environ.get("ROSEINFER_CACHE_DIR"):
        return pathlib.Path(os.environ["ROSEINFER_CACHE_DIR"]) / "kernels"
    home_cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    folder = home_cache / "roseinfer" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / f"roseinfer-{os.getuid()}" / "kernels"


def _build(compiler: str, sources: list[pathlib.Path], target: pathlib.Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, "-o", tmp, *map(str, sources), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelsUnavailable(f"compiling {', '.join(s.name for s in sources)} failed:\n"
                                           f"{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def native_library() -> ctypes.CDLL:
    """The compiled kernels, built on first use; raises NativeKernelsUnavailable with the reason."""
    sources = sorted(CSRC.glob("*.c"))
    headers = sorted(CSRC.glob("*.h"))
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256()
        for part in (*(s.read_bytes() for s in sources + headers), compiler.encode(), version.encode(),
                     " ".join(CFLAGS).encode(), platform.machine().encode(), _cpu_flags().encode()):
            key.update(part)
        target = _cache_dir() / f"roseinfer_kernels_{key.hexdigest()[:16]}.so"
        if not target.exists():
            logger.info("compiling the native CPU kernels into %s (once per machine and compiler)", target)
            _build(compiler, sources, target)
        library = ctypes.CDLL(str(target))
    except OSError as exc:  # an unwritable cache folder, a compiler that cannot run, a bad library
        raise NativeKernelsUnavailable(f"building or loading the kernels failed: {exc}") from exc
    _declare(library)
    return library


def _declare(library: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_decode_attention_f32": [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                       f32, i32],
        "paged_prefill_attention_f32": [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                        f32, i32],
        "store_kv_f32": [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr],
        "rms_norm_f32": [ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32],
        "silu_mul_f32": [ptr, ptr, i64, i64, i32],
        "rotary_f32": [ptr, i64, ptr, i64, i64, i64, i32],
        "argmax_rows_f32": [ptr, i64, i64, ptr, i32],
        "packed_matmul_f32": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32],
        "rms_norm_packed_matmul_f32": [ptr, i64, ptr, ptr, f32, ptr, ptr, ptr, i64, i64, i64, i32],
        "silu_mul_packed_matmul_f32": [ptr, ptr, ptr, ptr, i64, i64, i64, i32],
        "packed_matmul_steps_f32": [ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i32],
        "decode_layers_f32": [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, f32, f32,
                              i32],
    }
    # these return nonzero where they could not allocate their scratch
    allocating = ("paged_decode_attention_f32", "paged_prefill_attention_f32", "rms_norm_packed_matmul_f32",
                  "silu_mul_packed_matmul_f32", "decode_layers_f32")
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int if name in allocating else None


def native_kernels_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tensors of this dtype/device can use the kernels: CPU fp32, and the library builds
    here. A failed build is logged (with the compiler's message) and the torch paths are used."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    try:
        native_library()
    except NativeKernelsUnavailable as exc:
        logger.warning("native CPU kernels unavailable, using torch for every op: %s", exc)
        return False
    return True


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with contiguous rows (last dims dense), whatever the stride between rows. Checked on the
    strides: indexing a row to ask it took 2 us, a quarter of a small kernel's whole call."""
    dense = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != dense:
            return t.contiguous()
        dense *= size
    return t


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           kv_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q: [n, H, D], one query per sequence; caches: [slots, Hkv, D]; block_tables: [n, max_blocks];
    kv_lens: [n] tokens each query attends to. Returns [n, H, D]."""
    q = _rows(q)
    n, num_heads, head_dim = q.shape
    out = _decode_attention(q, None, None, k_cache, v_cache, block_tables, kv_lens, block_size, num_heads, scale)
    return out.view(n, num_heads, head_dim)


def decode_attention_qkv(qkv: torch.Tensor, rotations: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                         num_heads: int, scale: float) -> torch.Tensor:
    """Rotary on q and k, the KV write and decode attention in one call, for a batch where every row
    decodes. qkv: the projection's output [n, (H + 2 * Hkv) * D], rotated in place (where its rows
    are dense; otherwise a dense copy is); rotations: [n, 1, D / 2] complex64 (layers/rotary.py);
    slots: [n] cache slot of each new token. Returns [n, H * D]: exactly what rotary_, store_kv and
    paged_decode_attention give one after another."""
    angles = torch.view_as_real(rotations).contiguous()
    return _decode_attention(_rows(qkv), angles, slots, k_cache, v_cache, block_tables, kv_lens, block_size,
                             num_heads, scale)


def _decode_attention(q_rows: torch.Tensor, angles: torch.Tensor | None, slots: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                      block_size: int, num_heads: int, scale: float) -> torch.Tensor:
    """The kernel over q_rows [n, ...] whose first H * D floats per row are the query; with angles
    and slots, the row is a whole qkv row, rotated and stored first. Returns [n, H * D]."""
    n, num_kv_heads, head_dim = q_rows.shape[0], k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(n, num_heads * head_dim, dtype=q_rows.dtype)
    failed = native_library().paged_decode_attention_f32(
        q_rows.data_ptr(), q_rows.stride(0), None if angles is None else angles.data_ptr(),
        None if slots is None else slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), kv_lens.data_ptr(), n, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], scale,
        min(torch.get_num_threads(), n))  # one task per sequence: waking idle threads only costs time
    if failed:
        raise MemoryError("paged attention could not allocate its scratch buffers")
    return out


PREFILL_LANES = 64  # LANES in csrc/prefill_attention.c: query vectors one task holds side by side


def prefill_attention_supported(head_dim: int, group: int) -> bool:
    """paged_prefill_attention's vector loops take head dims that are whole 16-float chunks, up to 128,
    and a task holds at least one query row: the `group` query heads sharing a KV head fit its lanes."""
    return head_dim % 16 == 0 and head_dim <= 128 and group <= PREFILL_LANES


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                            scale: float, out: torch.Tensor) -> None:
    """Causal attention for prompt chunks: sequence i's queries are rows q_starts[i] .. + q_lens[i] - 1
    of q [rows, H, D], at the last q_lens[i] of its kv_lens[i] cached positions (this chunk's K/V
    already written). Writes those rows of out [rows, H, D] (contiguous); other rows are left alone."""
    q = _rows(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    if not prefill_attention_supported(head_dim, group) or not out.is_contiguous():
        raise ValueError(f"paged_prefill_attention needs a head dim that is a multiple of 16 up to 128 "
                         f"(got {head_dim}), at most {PREFILL_LANES} query heads per KV head (got {group}) "
                         f"and a contiguous out")
    failed = native_library().paged_prefill_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        q_starts.data_ptr(), q_lens.data_ptr(), kv_lens.data_ptr(), q_lens.shape[0], num_heads, k_cache.shape[1],
        head_dim, block_size, block_tables.shape[1], scale, torch.get_num_threads())
    if failed:
        raise MemoryError("prefill attention could not allocate its scratch buffers")


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v; k, v: [n, Hkv, D]."""
    k, v = _rows(k), _rows(v)
    native_library().store_kv_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                                  k.shape[0], k[0].numel() if k.shape[0] else 0, k_cache.data_ptr(), v_cache.data_ptr())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [n, dim]; with `residual` (contiguous [n, dim]), residual += x
    first, in place, and the sum is what gets normalised."""
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm's residual is updated in place and must be contiguous")
    x = _rows(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # 1 us; torch.empty(x.shape, ...) took 3
    native_library().rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                  weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                  torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [n, 2 * width] (contiguous) -> [n, width]."""
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # kept in a name: a temporary would be freed before the call reads it
    out = torch.empty(n, width, dtype=gate_up.dtype)
    native_library().silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), n, width, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotates x [n, heads, head_dim] (heads contiguous; rows may be strided) in place by
    rotations [n, 1, head_dim / 2] complex64 (layers/rotary.py); returns x."""
    if _rows(x) is not x:  # rotated where it lies, so it cannot be copied into shape
        raise ValueError("rotary_ needs each row's heads contiguous")
    angles = torch.view_as_real(rotations).contiguous()
    native_library().rotary_f32(x.data_ptr(), x.stride(0), angles.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                                torch.get_num_threads())
    return x


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for contiguous fp32 x [n, width]: ties and NaNs resolved the same way."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    native_library().argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


PACKED_MATMUL_MAX_ROWS = 256  # above it oneDNN's blocked GEMM is as fast or faster (layers/linear.py)
PACKED_MATMUL_BLOCK = 64  # BLOCK in csrc/packed_matmul.c: the row-block size of the packed layout it reads


@functools.cache
def packed_matmul_suits_cpu() -> bool:
    """The kernel holds 24 accumulators of 16 floats plus 4 of weights: AVX-512's 32 registers, where
    it was measured. With AVX2's 16 half-width ones they would spill, so other CPUs keep oneDNN."""
    return "avx512f" in _cpu_flags().split()


def packed_matmul(x: torch.Tensor, packed_ptr: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W.T (+ bias), where W [out_features, k] is packed at packed_ptr in 64-row blocks
    (layers/linear.py checks that layout). Returns [m, out_features]."""
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    native_library().packed_matmul_f32(x.data_ptr(), x.stride(0), packed_ptr,
                                       None if bias is None else bias.data_ptr(), out.data_ptr(), m, out_features, k,
                                       torch.get_num_threads())
    return out


def rms_norm_packed_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                           packed_ptr: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """packed_matmul(rms_norm(x, norm_weight, eps, residual), ...) in one call, with the same results
    (residual, when given, updated in place the same way)."""
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm_packed_matmul's residual is updated in place and must be contiguous")
    x = _rows(x)
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    failed = native_library().rms_norm_packed_matmul_f32(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), norm_weight.data_ptr(), eps,
        packed_ptr, None if bias is None else bias.data_ptr(), out.data_ptr(), m, out_features, k,
        torch.get_num_threads())
    if failed:
        raise MemoryError("rms_norm_packed_matmul could not allocate the normalised rows")
    return out


def silu_mul_packed_matmul(gate_up: torch.Tensor, packed_ptr: int, out_features: int,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """packed_matmul(silu_mul(gate_up), ...) in one call, with the same results."""
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # kept in a name: a temporary would be freed before the call reads it
    out = torch.empty(m, out_features, dtype=gate_up.dtype)
    failed = native_library().silu_mul_packed_matmul_f32(
        gate_up.data_ptr(), packed_ptr, None if bias is None else bias.data_ptr(), out.data_ptr(), m, out_features, k,
        torch.get_num_threads())
    if failed:
        raise MemoryError("silu_mul_packed_matmul could not allocate the activation")
    return out


class DecodeLayer(ctypes.Structure):
    """One decoder layer as decode_layers_f32 reads it (decode_layer_t in csrc/kernels.h): the
    norms' weights, the packed matmul weights (64-row blocks) and biases (NULL for none), and the
    layer's K/V cache."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias",
                                                     "gate_up", "down", "k_cache", "v_cache")]


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
        ctypes.addressof(layers), len(layers), x.data_ptr(), out.data_ptr(), angles.data_ptr(), slots.data_ptr(),
        block_tables.data_ptr(), kv_lens.data_ptr(), n, hidden, intermediate, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], eps, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("decode_layers could not allocate its buffers")
    return out


def packed_matmul_steps(weights: list[tuple[int, torch.Tensor | None, int, int]], x: torch.Tensor, steps: int) -> None:
    """`steps` times, x's rows times every packed weight (address, bias, out_features, in_features) in
    turn, all in one call: the matmul floor of a decode step that runs in C (decode_layers)."""
    count = len(weights)
    pointers = ctypes.c_void_p * count
    sizes = ctypes.c_int64 * count
    x = _rows(x)
    if any(in_features > x.shape[1] for _, _, _, in_features in weights):
        raise ValueError("packed_matmul_steps needs x as wide as the widest input")
    out = torch.empty(x.shape[0], max(w[2] for w in weights), dtype=x.dtype)
    native_library().packed_matmul_steps_f32(
        pointers(*(w[0] for w in weights)), pointers(*(None if w[1] is None else w[1].data_ptr() for w in weights)),
        sizes(*(w[2] for w in weights)), sizes(*(w[3] for w in weights)), count, x.data_ptr(), x.stride(0),
        out.data_ptr(), x.shape[0], steps, torch.get_num_threads())
