"""The CPU backend's C kernels as a library: built wherever a compiler is, cached (also where the home
cache cannot be written), bound from kernels.h by name, and the engine on torch ops without them."""
from __future__ import annotations

import ctypes
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import CPUBackend, kernels
from test_native_kernels import CPU, needs_kernels

@pytest.fixture
def rebuilt_library() -> Iterator[None]:
    """The test's environment (CC, cache folders) decides the next build; later tests rebuild
    (or reload from the real cache) with the real one."""
    kernels.native_library.cache_clear()
    yield
    kernels.native_library.cache_clear()


@needs_kernels
def test_kernels_build_wherever_a_compiler_is_found() -> None:
    assert kernels.kernels_available() and CPUBackend.supports(CPU, torch.float32)
    assert not CPUBackend.supports(CPU, torch.bfloat16)


def test_without_a_working_compiler_the_engine_runs_on_torch_ops(tiny_model_factory, monkeypatch, tmp_path,
                                                                   caplog, rebuilt_library) -> None:
    """A compiler that fails: the default engine logs why and runs torch ops only, with the same output."""
    folder = tiny_model_factory("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = LLM(model=str(folder), attention_backend="torch").generate([[5, 6, 7, 8]], greedy)[0].token_ids
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="roseinfer.backends.cpu.kernels"):
        llm = LLM(model=str(folder))
    assert llm.engine.backend.name == "torch"
    assert "native CPU kernels unavailable" in caplog.text and "failed" in caplog.text
    assert llm.generate([[5, 6, 7, 8]], greedy)[0].token_ids == reference
    assert not list(tmp_path.rglob("*.so"))


@needs_kernels
def test_an_unwritable_cache_folder_is_reported_not_raised(monkeypatch, tmp_path, rebuilt_library) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would have to be created inside a file
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(kernels.NativeKernelsUnavailable, match="building or loading"):
        kernels.native_library()
    assert not kernels.kernels_available()


@needs_kernels
def test_kernels_are_cached_in_the_temp_dir_when_the_home_cache_cannot_be_written(monkeypatch, tmp_path,
                                                                                  rebuilt_library) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache folder "inside" a file cannot be created, not even by root
    monkeypatch.delenv("ROSEINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    kernels.native_library()
    assert list((tmp_path / "tmp").rglob("roseinfer_kernels_*.so"))


def test_bindings_follow_the_header_by_name_so_a_moved_parameter_cannot_pass_a_wrong_value() -> None:
    """kernels.h is the one declaration: argtypes and the call order come from it, and callers name
    every argument, so reordering a C parameter reorders the call too; a renamed one fails loudly."""
    class Function:
        def __call__(self, *args: object) -> tuple:
            return args

    library = SimpleNamespace(f=Function(), g=Function())
    header = ("/* comment */\n#include <stdint.h>\ntypedef struct { const float *a, *b; float *c; } pair_t;\n"
              "void f(int64_t n, const float *x, float eps);\nint g(const pair_t *p, const float *const *w);\n")
    bound = kernels.Kernels(library, header)
    assert bound.f(eps=0.5, x=7, n=3) == (3, 7, 0.5)
    assert library.f.argtypes == [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float] and library.f.restype is None
    assert library.g.restype is ctypes.c_int and [name for name, _ in bound.structs["pair_t"]._fields_] == ["a", "b", "c"]
    moved = kernels.Kernels(library, header.replace("int64_t n, const float *x", "const float *x, int64_t n"))
    assert moved.f(eps=0.5, x=7, n=3) == (7, 3, 0.5)
    with pytest.raises(TypeError, match=r"missing \['n'\], unknown \['count'\]"):
        bound.f(count=3, x=7, eps=0.5)


@needs_kernels
def test_every_entry_point_of_the_real_header_is_bound() -> None:
    library = kernels.native_library()
    names = re.findall(r"^\s*(?:void|int)\s+(\w+)\(", kernels.HEADER.read_text(), flags=re.M)
    assert len(names) == 19 and all(isinstance(getattr(library, name), kernels.Kernel) for name in names)
    fields = [name for name, _ in library.structs["decode_layer_t"]._fields_]
    assert fields == ["input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down", "k_cache",
                      "v_cache", "qkv_type", "o_type", "gate_up_type", "down_type", "sliding_window",
                      "logit_softcap", "no_rope"]


@needs_kernels
def test_processes_starting_at_once_compile_the_kernels_once(monkeypatch, tmp_path, rebuilt_library) -> None:
    """Two callers find no library: the second waits on the first's file lock while the first builds,
    then loads what it built instead of compiling again."""
    built = kernels.native_library().library._name  # the session's library, standing in for a build
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path))
    waiting, builds = threading.Event(), []

    class SignallingLock(kernels.FileLock):
        def acquire(self, *args, **kwargs):
            if builds:  # the second caller, about to wait on the first
                waiting.set()
            return super().acquire(*args, **kwargs)

    def build(compiler, sources, target) -> None:
        builds.append(target)
        second.start()
        assert waiting.wait(timeout=300), "the second caller never reached the lock"
        shutil.copy(built, target)

    monkeypatch.setattr(kernels, "FileLock", SignallingLock)
    monkeypatch.setattr(kernels, "_build", build)
    load = kernels.native_library.__wrapped__  # past functools.cache: each call looks for the file
    loaded = []
    second = threading.Thread(target=lambda: loaded.append(load()))
    loaded.append(load())
    second.join()
    assert len(builds) == 1 and builds[0].exists()
    assert len(loaded) == 2 and all(library.library._name == str(builds[0]) for library in loaded)
