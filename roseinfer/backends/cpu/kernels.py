"""The CPU backend's C kernels (csrc/): compiled once per machine, bound from their one declaration.

Stock PyTorch has no CPU kernel that reads a paged KV cache in place, and on small decode batches
its chains of elementwise ops cost more in dispatch than in arithmetic. The few hot spots that
need it are plain C with OpenMP, not a torch extension: they compile once per machine in seconds
with the system C compiler (no torch headers, no pybind), and ctypes drops the GIL for the
call. `-fopenmp` links libgomp by its soname, which resolves to the copy torch has already loaded,
so the kernels share torch's OpenMP threads instead of starting a second pool.

The bindings are read from csrc/kernels.h, where every entry point is declared once (the C files
include it, so the compiler holds them to it): each function is called with its arguments named
as the header names them, and a struct there becomes a ctypes.Structure with its fields.

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
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from filelock import FileLock

logger = logging.getLogger(__name__)

CSRC = pathlib.Path(__file__).with_name("csrc")
HEADER = CSRC / "kernels.h"
# ISO C mode (-std=c11) turns floating-point contraction off, so every a * b + c in the vector loops
# was a multiply and an add: -ffp-contract=fast lets them be one FMA (prefill attention 5-8 % faster).
# -fno-trapping-math lets GCC turn exp_f32's clamp (a float comparison) into a blend, without which
# no loop calling it vectorized: SiLU and every softmax ran one float at a time. A softmax's sum
# (an `omp simd` reduction) now adds in vector lanes, as its pragma always allowed.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast",
          "-fno-trapping-math")
# the scalar C types the header uses; every pointer is passed as an address
SCALARS: dict[str, Any] = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here; the message says why."""


class Kernel:
    """One C function, called with keyword arguments named as in kernels.h."""

    def __init__(self, function: Any, name: str, params: list[str]) -> None:
        self.function, self.name, self.params = function, name, params

    def __call__(self, **args: Any) -> Any:
        try:
            values = [args[name] for name in self.params]
        except KeyError:
            values = None
        if values is None or len(args) != len(self.params):
            missing, extra = set(self.params) - set(args), set(args) - set(self.params)
            raise TypeError(f"{self.name}: missing {sorted(missing)}, unknown {sorted(extra)}")
        return self.function(*values)


class Kernels:
    """The library's functions as attributes (Kernel) and its structs as ctypes.Structure classes."""

    def __init__(self, library: ctypes.CDLL, header: str) -> None:
        self.library = library
        self.structs: dict[str, type[ctypes.Structure]] = {}
        text = _strip(header)
        for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
            fields = [(field, _ctype(kind, pointer)) for kind, pointer, field in _declarators(body)]
            self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
        text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", "", text, flags=re.S)
        for returns, name, params in re.findall(r"(\w+)\s+(\w+)\s*\(([^)]*)\)\s*;", text):
            parsed = [_parameter(p) for p in params.split(",")]
            function = getattr(library, name)
            function.argtypes = [ctype for ctype, _ in parsed]
            function.restype = None if returns == "void" else SCALARS[returns]
            setattr(self, name, Kernel(function, name, [param for _, param in parsed]))


def _strip(source: str) -> str:
    """The header without comments and preprocessor lines."""
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    source = re.sub(r"//[^\n]*", "", source)
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


def _ctype(kind: str, pointer: bool) -> Any:
    return ctypes.c_void_p if pointer else SCALARS[kind]


def _parameter(text: str) -> tuple[Any, str]:
    """'const float *x' -> (c_void_p, 'x'); 'int64_t n' -> (c_int64, 'n')."""
    match = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*((?:\*\s*(?:const\s*)?)*)(\w+)\s*", text)
    if match is None:
        raise NativeKernelsUnavailable(f"kernels.h: cannot read the parameter {text.strip()!r}")
    kind, stars, name = match.groups()
    return _ctype(kind, "*" in stars), name


def _declarators(body: str) -> list[tuple[str, bool, str]]:
    """A struct body's fields as (type, is pointer, name); 'const float *a, *b;' gives two."""
    fields = []
    for statement in filter(str.strip, body.split(";")):
        match = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s+(.*)", statement, re.S)
        kind, names = match.groups()
        for declarator in names.split(","):
            fields.append((kind, "*" in declarator, declarator.replace("*", "").strip()))
    return fields


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeKernelsUnavailable("no C compiler found (set CC, or install gcc)")


def cpu_flags() -> str:
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
    # build beside the target and rename: concurrent processes never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # each source compiled by a compiler of its own, at once, then linked: one command for them all
        # compiles them one after another (the same objects; 11.7 s -> 7.9 s on 2 cores)
        objects = [pathlib.Path(tmp) / f"{source.stem}.o" for source in sources]
        commands = [[compiler, *CFLAGS, "-c", "-o", str(obj), str(source)] for source, obj in zip(sources, objects)]
        with ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1)) as pool:
            runs = list(pool.map(lambda command: subprocess.run(command, capture_output=True, text=True), commands))
        if failed := [run for run in runs if run.returncode != 0]:
            raise NativeKernelsUnavailable(f"compiling {', '.join(s.name for s in sources)} failed:\n"
                                           + "\n".join(run.stderr.strip() for run in failed))
        library = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, "-o", str(library), *map(str, objects), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelsUnavailable(f"linking {', '.join(s.name for s in sources)} failed:\n"
                                           f"{result.stderr.strip()}")
        os.replace(library, target)


@functools.cache
def native_library() -> Kernels:
    """The compiled kernels, built on first use; raises NativeKernelsUnavailable with the reason."""
    sources = sorted(CSRC.glob("*.c"))
    headers = sorted(CSRC.glob("*.h"))
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256()
        for part in (*(s.read_bytes() for s in sources + headers), compiler.encode(), version.encode(),
                     " ".join(CFLAGS).encode(), platform.machine().encode(), cpu_flags().encode()):
            key.update(part)
        target = _cache_dir() / f"roseinfer_kernels_{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # processes starting at once (tensor-parallel ranks, test workers) compile it once: the rest wait
            with FileLock(target.with_suffix(".lock")):
                if not target.exists():
                    logger.info("compiling the native CPU kernels into %s (once per machine and compiler)", target)
                    _build(compiler, sources, target)
        library = ctypes.CDLL(str(target))
    except OSError as exc:  # an unwritable cache folder, a compiler that cannot run, a bad library
        raise NativeKernelsUnavailable(f"building or loading the kernels failed: {exc}") from exc
    return Kernels(library, HEADER.read_text())


def kernels_available() -> bool:
    """Whether the library builds and loads here. A failure is logged with the compiler's message."""
    try:
        native_library()
    except NativeKernelsUnavailable as exc:
        logger.warning("native CPU kernels unavailable: %s", exc)
        return False
    return True
