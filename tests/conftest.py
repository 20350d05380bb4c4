"""Shared fixtures: tiny random checkpoints (one per architecture), their tokenizer, and the
HF transformers greedy reference. Built once per test session into a temp folder."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterator

import pytest

from tiny_models import ARCHS, build_tiny_model, hf_greedy, train_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    # Triton kernels run on CPU tensors in Triton's interpreter where there is no GPU. It must be on
    # before anything imports triton, and transformers does as it loads.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # GGUF conversions (and kernel builds) go to a folder of this run's, never the user's cache, which
    # no test cleans: converted folders of temp files would pile up there run after run.
    if "ROSEINFER_CACHE_DIR" not in os.environ:
        os.environ["ROSEINFER_CACHE_DIR"] = config._roseinfer_cache = tempfile.mkdtemp(prefix="roseinfer-tests-")
    # Also declared in pyproject.toml; repeated here so the markers exist under any rootdir.
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    config.addinivalue_line("markers", "slow: loads the default model")
    config.addinivalue_line("markers", "install: builds the wheel and installs it into an empty venv from PyPI")
    config.addinivalue_line("markers", "triton: Triton kernels, run on CPU under TRITON_INTERPRET=1")


def pytest_unconfigure(config: pytest.Config) -> None:
    if cache := getattr(config, "_roseinfer_cache", None):
        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop("ROSEINFER_CACHE_DIR", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `@pytest.mark.cuda` tests on machines without a GPU instead of failing them."""
    if not any(item.get_closest_marker("cuda") for item in items):
        return  # don't pay for the torch import/CUDA probe when nothing asks for it
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_builds() -> pathlib.Path:
    """Where the per-ISA builds of the kernels go (test_quant_kernel_builds.kernels_built_for): in the
    run's cache folder, which pytest-xdist's workers share, so each build compiles once a run however
    many tests, and workers, use it."""
    return pathlib.Path(os.environ["ROSEINFER_CACHE_DIR"]) / "kernel-builds"


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_models_root: pathlib.Path) -> pathlib.Path:
    """A folder with just tokenizer.json + tokenizer_config.json (incl. chat_template)."""
    out = tiny_models_root / "tokenizer"
    train_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_models_root: pathlib.Path) -> Callable[[str], pathlib.Path]:
    """`tiny_model_factory("qwen3")` -> checkpoint folder; each arch is built at most once per
    session, so tests that need one specific arch need not parametrize over all of them."""
    built: dict[str, pathlib.Path] = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tiny_models_root / arch)
        return built[arch]

    return get


@pytest.fixture(scope="session", params=ARCHS, ids=ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[[str], pathlib.Path]) -> pathlib.Path:
    """Every test using this runs once per architecture in tiny_models.ARCHS."""
    return tiny_model_factory(request.param)


@pytest.fixture
def hf_reference() -> Callable[[str | pathlib.Path, list[int], int], list[int]]:
    """`hf_reference(model_dir, prompt_ids, max_new_tokens)` -> HF greedy new ids (no EOS stop)."""
    return hf_greedy


@pytest.fixture
def restore_torch_threads() -> Iterator[None]:
    """Commands given --num-threads set torch's process-wide thread count; give later tests theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def packed_matmul_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine sends matmuls to csrc/packed_matmul.c on AVX-512 and AVX2 CPUs only, up to a row
    count that depends on the ISA, but the C is portable: tests run it on any CPU and up to AVX-512's
    256 rows, so that its results are checked wherever the suite runs. Use before building the model."""
    from roseinfer.backends.cpu import ops

    monkeypatch.setattr(ops, "packed_matmul_suits_cpu", lambda: True)
    monkeypatch.setattr(ops, "PACKED_MATMUL_MAX_ROWS", 256)
