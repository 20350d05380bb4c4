"""The CPU backend's C kernels under AddressSanitizer: each harness (tests/*_asan.c) runs kernels of
backends/cpu/csrc on buffers of exact size, so any read or write past them, or past the kernels' own
scratch buffers, is reported, including ones whose results stay right (prefill's lane blocks once read
past the scores scratch at head dim 128, 64 lanes, and no equality test saw it). Each kernel source
compiles once into an object that every harness linking it shares: compiling, not running, is what
these cost."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from roseinfer.backends.cpu import kernels

TESTS = pathlib.Path(__file__).parent
# csrc/quant_matmul.c hands a weight with int8 activations to these: every harness that links it links them
QUANT_SOURCES = ("quant_matmul.c", "kquant.c", "kquant_row.c", "quant_tiled_matmul.c", "kquant_pipelined_tiles.c",
                 "q8_activations.c",
                 "q8_dot_kquants.c", "q8_dot_blocks32.c", "q8_gemm.c", "q8_gemm_blocks32.c")
HARNESSES: dict[str, tuple[str, ...]] = {
    # both attention kernels, decode with rotary and the K/V write fused in
    "attention_kernels_asan.c": ("prefill_attention.c", "paged_attention.c"),
    # a whole decode step in one call: the norm and SiLU matmul calls and decode attention together
    "decode_layers_asan.c": ("decode_layers.c", "packed_matmul.c", "paged_attention.c", *QUANT_SOURCES),
    # the GGUF-block matmul and row lookup: every type, partial row groups and tiles
    "quant_matmul_asan.c": QUANT_SOURCES,
    # the 8-bit activation matmul: every type, partial row groups and tiles, behind the norm prologue,
    # Q4_K and Q6_K also repacked, through the GEMM
    "q8_activations_asan.c": ("packed_matmul.c", *QUANT_SOURCES),
    # a mixture-of-experts layer's routed experts in one call: every type, alone and paired, 1 to 48 tokens;
    # Q4_K and Q6_K also repacked for int8 activations
    "moe_experts_asan.c": ("moe_experts.c", *QUANT_SOURCES),
}
FLAGS = [flag for flag in kernels.CFLAGS if flag not in ("-shared", "-fPIC")]  # the kernels' own flags
# GCC folds simd.h's vector memcpy into moves it does not instrument (a tile buffer one thread short
# went unreported): kept as calls, ASan's interceptor checks every vector load and store.
FLAGS += ["-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-fno-builtin-memcpy", f"-I{kernels.CSRC}"]


def _compile(compiler: str, source: pathlib.Path, obj: pathlib.Path) -> str | None:
    """The compiler's complaint, or None once `obj` is built."""
    result = subprocess.run([compiler, *FLAGS, "-c", "-o", str(obj), str(source)], capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr


@pytest.fixture(scope="module")
def asan_objects(tmp_path_factory) -> tuple[str, dict[str, pathlib.Path]]:
    """The compiler and every kernel source and harness as an ASan object, compiled once, in parallel."""
    compiler = shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no gcc or clang to build the AddressSanitizer harnesses")
    folder = tmp_path_factory.mktemp("asan")
    # Some compiler/kernel pairs build ASan binaries that cannot start (shadow memory vs address
    # randomisation): an empty program tells that apart from a report about the kernels.
    empty = folder / "empty.c"
    empty.write_text("int main(void) { return 0; }\n")
    probe = subprocess.run([compiler, *FLAGS, "-o", str(folder / "empty"), str(empty)], capture_output=True)
    if probe.returncode != 0 or subprocess.run([str(folder / "empty")], capture_output=True).returncode != 0:
        pytest.skip("AddressSanitizer cannot build or run a program here")
    sources = {name: kernels.CSRC / name for sources in HARNESSES.values() for name in sources}
    sources |= {name: TESTS / name for name in HARNESSES}
    objects = {name: folder / f"{pathlib.Path(name).stem}.o" for name in sources}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        complaints = dict(zip(sources, pool.map(_compile, [compiler] * len(sources), sources.values(),
                                                objects.values())))
    failed = {name: complaint for name, complaint in complaints.items() if complaint is not None}
    assert not failed, f"did not compile under ASan although an empty program did: {failed}"
    return compiler, objects


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_kernels_stay_inside_their_buffers_under_address_sanitizer(asan_objects, harness: str) -> None:
    compiler, objects = asan_objects
    binary = objects[harness].with_suffix("")
    linked = subprocess.run([compiler, *FLAGS, "-o", str(binary), str(objects[harness]),
                             *(str(objects[name]) for name in HARNESSES[harness]), "-lm"],
                            capture_output=True, text=True)
    assert linked.returncode == 0, linked.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
