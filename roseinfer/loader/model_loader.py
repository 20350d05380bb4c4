"""Resolve a model argument (HF folder, GGUF file, hub id, or nothing) to a HF folder and load it."""
from __future__ import annotations

import ctypes
import functools
import json
import mmap
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from roseinfer.layers.activation import ActivationAndMul
from roseinfer.layers.embedding import VocabEmbedding
from roseinfer.layers.linear import Linear, can_prepack, linear_layers, prepack_linears
from roseinfer.layers.norm import RMSNorm
from roseinfer.loader.default_model import default_model_path
from roseinfer.loader.gguf import convert_gguf
from roseinfer.models.config import ModelConfig
from roseinfer.models.registry import build_model


class ModelLoadError(ValueError):
    """A model that cannot be found or read; the message is one line a user can act on."""


def resolve_model_folder(model: str | None) -> Path:
    if model is None:
        return convert_gguf(default_model_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{model}: a model file must be a .gguf file (or pass a Hugging Face folder)")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return convert_gguf(ggufs[0])
            raise ModelLoadError(f"{model}: folder has no config.json (not a Hugging Face model folder)")
        return path
    looks_like_hub_id = model.count("/") <= 1 and not model.startswith((".", "/", "~")) and not model.endswith(".gguf")
    if not looks_like_hub_id:
        raise ModelLoadError(f"{model}: no such file or folder")
    return _download(model)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # noqa: BLE001 -- any hub failure becomes one actionable line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # a bare name may be a mistyped local path as well as a hub id: say both
        raise ModelLoadError(f"{repo_id}: no such file or folder here, and no Hugging Face hub repo of that id "
                             f"could be fetched ({reason}); pass a local folder or .gguf file") from None
    return Path(folder)


def load_model_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            # Opened again per tensor: the file is memory-mapped, and every page read stays in this
            # process's resident set until the mapping closes. Kept open for the whole file, the
            # checkpoint's pages and the model's own copy were resident together (1293 MiB peak
            # loading the default model, against 877 MiB once loaded).
            with safe_open(str(folder / name), framework="pt") as f:
                yield key, f.get_tensor(key)


def load_model(folder: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
               prepack: bool = True, native: bool = False, mmap_embeddings: bool = True) -> nn.Module:
    """`native`: switch the layers that have a C kernel (RMSNorm, SiLU-and-mul, matmuls of up to 256 rows)
    onto it; the caller has checked `native_kernels_available`. `mmap_embeddings=False` copies embedding tables out of
    the checkpoint's memory map (models/weights.py), so nothing reads the file after loading."""
    with torch.device(device):
        model = build_model(model_config)
    model.to(dtype)
    model.load_weights(iter_safetensors(folder))
    if prepack and can_prepack(dtype, device):
        tied = _tied_embeddings(model)  # before packing drops the heads' dense weights
        prepack_linears(model)
        for head, embedding in tied:
            embedding.read_rows_from(head)
    if native:
        for module in model.modules():
            if isinstance(module, (RMSNorm, ActivationAndMul, Linear)):
                module.use_native()
    if not mmap_embeddings:
        _copy_mapped_params(model)
    if device.type == "cpu":
        return_freed_memory()
        _drop_mapped_pages(model)
    return model.eval()


def _tied_embeddings(model: nn.Module) -> list[tuple[Linear, VocabEmbedding]]:
    """(LM head, embedding) pairs that share one weight: after prepacking, the embedding can look
    its rows up in the head's packed copy instead of keeping a dense table (layers/embedding.py)."""
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, VocabEmbedding)}
    return [(layer, tables[id(layer.weight)]) for layer in linear_layers(model) if id(layer.weight) in tables]


def return_freed_memory() -> None:
    """Loading frees the checkpoint's tensors and, with prepacking, the dense weights; glibc keeps
    much of that in its heap. Handing it back cut resident memory after loading the default model
    from 948 to 877 MiB (the engine's peak RSS counts against weights + KV pool + 300 MB)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # not glibc: nothing to trim this way
        libc.malloc_trim(0)


def _mapped_params(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that are the checkpoint's memory map (models/weights.py)."""
    return (param for param in model.parameters() if getattr(param, "checkpoint_mapped", False))


def _copy_mapped_params(model: nn.Module) -> None:
    for param in _mapped_params(model):
        param.data = param.data.clone()
        param.checkpoint_mapped = False


def _drop_mapped_pages(model: nn.Module) -> None:
    """A mapped table that is still the embedding's after prepacking (a tied one whose packed layout
    the embedding could not read, layers/embedding.py) was read whole to pack the head, and its
    pages would stay in this process's resident set. Dropping them is safe because the mapping is
    read-only in use and backed by the file: a later lookup pages its rows back in."""
    libc = _libc()
    if libc is None:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for param in _mapped_params(model):
        address, size = param.data_ptr(), param.numel() * param.element_size()
        start, end = -(-address // page) * page, (address + size) // page * page
        # MADV_DONTNEED on anonymous memory would zero it: only ever on a range the file maps
        if end <= start or not _file_backed(start, end):
            continue
        libc.madvise(start, end - start, mmap.MADV_DONTNEED)
        # lookups read scattered rows: without this, each one faults in the kernel's read-around too
        libc.madvise(start, end - start, mmap.MADV_RANDOM)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not a glibc system
        return None


def _file_backed(start: int, end: int) -> bool:
    """[start, end) lies in one private mapping of a regular file (from /proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= start and end <= high:
            return len(fields) >= 6 and fields[1].endswith("p") and int(fields[4]) != 0 and fields[5].startswith("/")
    return False
