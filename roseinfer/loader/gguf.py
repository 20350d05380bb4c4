"""Load GGUF checkpoints by converting them once into a Hugging Face folder.

The rest of roseinfer only knows how to load HF-style folders (config.json +
model.safetensors + tokenizer files). Rather than teaching every model class
about GGUF, a GGUF file is converted once into such a folder: every tensor is
dequantized to float32, renamed to the HF parameter name and, for the llama
family, un-permuted (loader/gguf_architectures.py). The folder is cached, keyed by
the file's identity, so only the first load pays for the conversion.

With `keep_blocks` (--quantization gguf / auto), matrices of the types in KEPT_TYPES are stored as
their raw blocks instead: uint8 [rows, bytes per row], each row a whole number of blocks along the
input dim, so the row reorderings act on them unchanged (stacked experts' 3-D tensors [E, rows, bytes
per row] likewise); QUANTIZATION_FILE names each such tensor's
type and shape (loader/quantized.py reads it). That folder has its own cache key, and Hugging Face
transformers cannot load it: only the fp32 folder (--quantization none) is an HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roseinfer.loader.gguf_architectures import (ROPE_FACTOR_TENSORS, SUPPORTED_ARCHITECTURES, TensorPlan, build_config,
                                                 plan_tensors)

logger = logging.getLogger(__name__)

# Bump whenever the output of the conversion changes, so stale caches are ignored.
_CONVERTER_VERSION = 4
# kept as blocks with keep_blocks
KEPT_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
QUANTIZATION_FILE = "roseinfer_quantization.json"
_SOURCE_FILE = "roseinfer_gguf_source.json"
_GGUF_MAGIC = b"GGUF"
_SHARD_BYTES = 2 * 2**30  # big models are written in shards of this size
# transformers reads no config of these (or, for gpt-oss, fails on its rope scaling fields)
_NO_TRANSFORMERS_GGUF_CONFIG = frozenset({"smollm3", "gemma4", "olmoe", "gpt-oss", "deepseek2", "qwen3next"})


def default_cache_root() -> Path:
    """Cache root: $ROSEINFER_CACHE_DIR, else $XDG_CACHE_HOME/roseinfer, else ~/.cache/roseinfer."""
    if env := os.environ.get("ROSEINFER_CACHE_DIR"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "roseinfer"
    return Path.home() / ".cache" / "roseinfer"


_BLOCKS_FOLDER = ("quantized matrices kept as uint8 blocks, which only roseinfer reads; --quantization none "
                  "converts into an fp32 folder that Hugging Face transformers loads")
_FP32_FOLDER = "every tensor dequantized: Hugging Face transformers loads it"


def convert_gguf(gguf_path: str | os.PathLike[str], cache_dir: str | None = None, keep_blocks: bool = False) -> Path:
    """Convert a GGUF file into a cached HF folder and return the folder's path; with keep_blocks,
    matrices of KEPT_TYPES stay in their blocks (see the module's docstring).

    The cache key hashes the absolute path, size and mtime, so an edited or replaced
    file is converted again while an unchanged one returns at once.
    """
    src = Path(gguf_path).expanduser().resolve()
    st = src.stat()  # FileNotFoundError for a missing file is the clearest message.
    key_src = f"{src}\0{st.st_size}\0{st.st_mtime_ns}\0v{_CONVERTER_VERSION}" + ("\0blocks" if keep_blocks else "")
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    parent = (Path(cache_dir).expanduser() if cache_dir else default_cache_root()) / "gguf"
    final = parent / key
    if (final / "config.json").is_file():  # complete by construction: renamed in atomically
        return final

    _check_magic(src)
    parent.mkdir(parents=True, exist_ok=True)
    # Build into a temp dir beside the final one (same filesystem) and rename it in at
    # the end, so a crash or a concurrent reader never sees a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=parent))
    try:
        # which folder Hugging Face transformers can load is not obvious from its name (a hash)
        logger.info("converting %s into %s (%s)", src, final, _BLOCKS_FOLDER if keep_blocks else _FP32_FOLDER)
        _convert_into(src, tmp, keep_blocks)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune_stale(parent, src)
    return final


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        if (magic := f.read(4)) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {_GGUF_MAGIC!r}")


@dataclass(frozen=True)
class _RawTensor:
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (GGUF stores dimensions innermost first)
    data: np.ndarray  # raw data shaped as gguf.quants.dequantize expects (memory-mapped)


def _parse_gguf(path: Path) -> tuple[dict[str, Any], dict[str, _RawTensor]]:
    """Metadata and tensors through gguf-py's reader; tensor data stays memory-mapped.

    The tokenizer arrays are left unread (transformers rebuilds the tokenizer itself)."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
        meta: dict[str, Any] = {}
        for key, field in reader.fields.items():
            is_array = field.types and field.types[0] == GGUFValueType.ARRAY
            if not (is_array and key.startswith("tokenizer.ggml.")):
                meta[key] = field.contents()
        tensors = {
            t.name: _RawTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data)
            for t in reader.tensors
        }
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    return meta, tensors


def _convert_into(src: Path, out: Path, keep_blocks: bool) -> None:
    meta, tensors = _parse_gguf(src)
    arch = str(meta.get("general.architecture", "<missing>"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{src}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shapes = {name: t.shape for name, t in tensors.items()}
    freqs = tensors.get("rope_freqs.weight")  # Gemma 4 reads which pairs it rotates from it
    rope_freqs = None if freqs is None else _dequantize(freqs, TensorPlan(freqs.name, freqs.name, freqs.shape))
    rope_factors = {name: _dequantize(tensors[name], TensorPlan(name, name, tensors[name].shape)).tolist()
                    for name in ROPE_FACTOR_TENSORS if name in tensors}
    config = build_config(arch, meta, shapes, rope_freqs, rope_factors)
    plans = plan_tensors(arch, config, shapes)
    if keep_blocks:
        plans = [_kept_as_blocks(plan, tensors[plan.gguf_name]) for plan in plans]

    # The tokenizer rebuild is the slowest step and mostly Python; it runs in a thread
    # while this one dequantizes and writes (numpy and file I/O release the GIL).
    # Leaving the `with` waits for the thread even on error, so it never writes into a
    # temp dir that the caller is already removing.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tok_job = pool.submit(_save_tokenizer, src, out, arch) if "tokenizer.ggml.model" in meta else None
        _write_safetensors(out, plans, lambda p: _stored(tensors[p.gguf_name], p))
    if tok_job is not None:
        tok_job.result()  # re-raises a tokenizer failure
    else:
        logger.warning("%s has no tokenizer metadata; the folder will have no tokenizer files", src)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if keep_blocks:
        kept = {p.hf_name: {"type": p.blocks[0], "shape": list(p.shape)} for p in plans if p.blocks is not None}
        (out / QUANTIZATION_FILE).write_text(json.dumps({"quant_method": "gguf", "tensors": kept}, indent=1) + "\n")
    (out / _SOURCE_FILE).write_text(json.dumps(_source_record(src), indent=2) + "\n")


def _source_record(src: Path) -> dict[str, Any]:
    st = src.stat()
    return {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "converter_version": _CONVERTER_VERSION}


def _prune_stale(parent: Path, src: Path) -> None:
    """Remove cached folders that no load can hit again: those of an older version of `src` (the file
    was replaced, or the converter changed) and those whose GGUF file is gone. Each is as big as its
    model, so without this the cache only grows."""
    current = _source_record(src)
    for folder in parent.iterdir():
        try:
            record = json.loads((folder / _SOURCE_FILE).read_text())
            source = Path(record["source"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a folder being built, or not one of ours
        replaced = source == src and record != current
        if replaced or not source.exists():
            logger.info("removing %s from the GGUF cache: %s", folder,
                        "its source changed" if replaced else f"{source} no longer exists")
            shutil.rmtree(folder, ignore_errors=True)


def _kept_as_blocks(plan: TensorPlan, tensor: _RawTensor) -> TensorPlan:
    """The plan storing the tensor's raw blocks where it is a matrix of a kept type whose transform,
    if any, reorders whole rows, or stacked matrices (experts) that no transform touches."""
    stacked = len(plan.shape) == 3 and plan.transform is None
    if tensor.qtype.name not in KEPT_TYPES or not (len(plan.shape) == 2 or stacked) or plan.on_columns:
        return plan
    return dataclasses.replace(plan, blocks=(tensor.qtype.name, int(tensor.data.shape[-1])))


def _stored(tensor: _RawTensor, plan: TensorPlan) -> np.ndarray:
    if plan.blocks is None:
        return _dequantize(tensor, plan)
    data = tensor.data.reshape(plan.stored_shape)  # uint8, one row of blocks per output row
    return np.ascontiguousarray(data if plan.transform is None else plan.transform(data))


def _dequantize(tensor: _RawTensor, plan: TensorPlan) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.qtype)  # (..., bytes per row) -> (..., cols)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize {tensor.name} of type {tensor.qtype.name}: {e}") from e
    data = data.reshape(tensor.shape)
    if plan.transform is not None:
        data = plan.transform(data)
    return np.ascontiguousarray(data, dtype=np.float32)


def _write_safetensors(out: Path, plans: list[TensorPlan], produce: Callable[[TensorPlan], np.ndarray]) -> None:
    """Write the tensors with the safetensors library, in shards of at most _SHARD_BYTES (HF's
    sharded layout with an index when there is more than one), so peak memory is one shard."""
    from safetensors.numpy import save_file

    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        nbytes = plan.stored_bytes
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += nbytes
    count = len(shards)
    names = ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                      for i in range(1, count + 1)]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        tensors = {}
        for plan in shard:
            arr = produce(plan)
            if arr.shape != plan.stored_shape:
                raise AssertionError(f"{plan.gguf_name}: got shape {arr.shape}, planned {plan.stored_shape}")
            tensors[plan.hf_name] = arr
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({plan.hf_name: name for plan in shard})
    if count > 1:
        index = {"metadata": {"total_size": sum(p.stored_bytes for p in plans)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_tokenizer(src: Path, out: Path, arch: str) -> None:
    # transformers rebuilds a fast tokenizer (vocab, merges, special tokens, chat
    # template) from the GGUF metadata; saving it makes the folder self-contained.
    # AutoTokenizer reads the file's model config first, only to pick a class, and transformers
    # reads none for some architectures (or fails on Gemma 4's per-layer lists): the fast class
    # builds the same tokenizer without it.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_class = PreTrainedTokenizerFast if arch in _NO_TRANSFORMERS_GGUF_CONFIG else AutoTokenizer
    tok = tokenizer_class.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(out))

