"""CPU time of one decode step's matmuls on a real GGUF, two builds of the kernels alternating.

Every quantized 2-D weight of the file is multiplied once by M rows of x (the tied embedding as the
LM head), through `quant_matmul_f32` on one thread, in the C kernels of two source folders (before:
--before-csrc, e.g. another checkout's roseinfer/backends/cpu/csrc; after: this checkout's), each
built with the backend's flags. CPU time rather than wall time, best of --repeats: a busy machine
inflates it far less than the end-to-end figures, so before / after stays readable there.

    python benchmarks/gguf_step_matmuls.py --gguf FILE --before-csrc OTHER/roseinfer/backends/cpu/csrc [--rows 1,16,64]
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGUFReader

from roseinfer.backends.cpu import kernels


def build(csrc: pathlib.Path, target: pathlib.Path) -> ctypes.CDLL:
    subprocess.run(["cc", *kernels.CFLAGS, "-o", str(target), *map(str, sorted(csrc.glob("*.c"))), "-lm"],
                   check=True, capture_output=True)
    library = ctypes.CDLL(str(target))
    library.quant_matmul_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int]
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=pathlib.Path, required=True)
    parser.add_argument("--before-csrc", type=pathlib.Path, required=True)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    weights = [(np.ascontiguousarray(t.data), int(t.tensor_type), int(t.shape[1]), int(t.shape[0]))
               for t in GGUFReader(str(args.gguf)).tensors if len(t.shape) == 2 and t.tensor_type.name[0] == "Q"]
    total = sum(w.nbytes for w, *_ in weights)
    widest, most = max(k for *_, k in weights), max(n for *_, n, _ in weights)
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(2) as pool:  # both builds at once: each compiles its sources one by one
            builds = {"before": pool.submit(build, args.before_csrc, pathlib.Path(tmp) / "before.so"),
                      "after": pool.submit(build, kernels.CSRC, pathlib.Path(tmp) / "after.so")}
        libraries = {name: future.result() for name, future in builds.items()}
        print(f"{args.gguf.name}: {len(weights)} weights, {total / 1e9:.3f} GB")
        for m in (int(r) for r in args.rows.split(",")):
            x = np.random.default_rng(0).standard_normal((m, widest)).astype(np.float32)
            out = np.zeros((m, most), np.float32)
            times: dict[str, list[float]] = {name: [] for name in libraries}
            for _ in range(args.repeats):
                for name, library in libraries.items():
                    start = time.process_time()
                    for w, qtype, n, k in weights:
                        if library.quant_matmul_f32(x.ctypes.data, widest, w.ctypes.data, qtype, None,
                                                    out.ctypes.data, m, n, k, 1) != 0:
                            raise SystemExit(f"{name}: type {qtype} not handled")
                    times[name].append(time.process_time() - start)
            before, after = min(times["before"]), min(times["after"])
            print(f"rows {m}: before {before * 1e3:.0f} ms, after {after * 1e3:.0f} ms CPU a step (1 thread), "
                  f"after / before speed {before / after:.2f}")


if __name__ == "__main__":
    main()
