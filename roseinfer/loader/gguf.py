"""Load GGUF checkpoints by converting them once into a Hugging Face folder.

The rest of roseinfer only knows how to load HF-style folders (config.json +
model.safetensors + tokenizer files). Rather than teaching every model class
about GGUF, a GGUF file is converted once into such a folder: every tensor is
dequantized to float32, renamed to the HF parameter name and, for the llama
family, un-permuted (see `_unpermute_rotary`). The folder is cached, keyed by
the file's identity, so only the first load pays for the conversion.

With `keep_blocks` (--quantization gguf / auto), matrices of the types in KEPT_TYPES are stored as
their raw blocks instead: uint8 [rows, bytes per row], each row a whole number of blocks along the
input dim, so the row reorderings act on them unchanged; QUANTIZATION_FILE names each such tensor's
type and shape (loader/quantized.py reads it). That folder has its own cache key, and Hugging Face
transformers cannot load it: only the fp32 folder (--quantization none) is an HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

# Bump whenever the output of the conversion changes, so stale caches are ignored.
_CONVERTER_VERSION = 1
KEPT_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")  # kept as blocks with keep_blocks
QUANTIZATION_FILE = "roseinfer_quantization.json"
_GGUF_MAGIC = b"GGUF"
_SHARD_BYTES = 2 * 2**30  # big models are written in shards of this size

# GGUF per-block tensor name -> HF name inside `model.layers.N.` (llama-like families).
_LLAMA_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_LLAMA_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF per-block tensor name -> HF name inside `transformer.h.N.` (gpt2).
_GPT2_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}  # fmt: skip
_GPT2_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f", "output": "lm_head",
}  # fmt: skip
# HF GPT-2 uses Conv1D layers that store weights as (in, out); llama.cpp transposes
# them to the usual (out, in), so they must be transposed back.
_GPT2_CONV1D = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})
# Tensors that have no HF parameter. rope_freqs carries llama3-style rope factors that
# HF expresses through rope_scaling instead; we cannot recover those parameters
# exactly, so the tensor is dropped with a warning.
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
_HF_CLASSES: dict[str, str] = dict(llama="LlamaForCausalLM", mistral="MistralForCausalLM",
                                    qwen2="Qwen2ForCausalLM", qwen3="Qwen3ForCausalLM", gpt2="GPT2LMHeadModel")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class _TensorPlan:
    """How one GGUF tensor becomes one HF tensor."""
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dimensions reversed)
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    transposed: bool = False  # the transform is a transpose (it cannot act on rows of blocks)
    blocks: tuple[str, int] | None = None  # (GGML type, bytes per row) where stored as raw blocks

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape if self.blocks is None else (self.shape[0], self.blocks[1])

    @property
    def stored_bytes(self) -> int:
        return int(np.prod(self.stored_shape, dtype=np.int64)) * (1 if self.blocks else 4)


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
    config = _build_config(arch, meta, shapes)
    plans = _plan_tensors(arch, config, shapes)
    if keep_blocks:
        plans = [_kept_as_blocks(plan, tensors[plan.gguf_name]) for plan in plans]

    # The tokenizer rebuild is the slowest step and mostly Python; it runs in a thread
    # while this one dequantizes and writes (numpy and file I/O release the GIL).
    # Leaving the `with` waits for the thread even on error, so it never writes into a
    # temp dir that the caller is already removing.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tok_job = pool.submit(_save_tokenizer, src, out) if "tokenizer.ggml.model" in meta else None
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
    source = {"source": str(src), "converter_version": _CONVERTER_VERSION}
    (out / "roseinfer_gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _build_config(arch: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        if required and f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{key}")
        return meta.get(f"{arch}.{key}", default)

    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    # The embedding matrix is the ground truth for the vocabulary size (the metadata
    # key is optional and the tokenizer list may be shorter than the padded matrix).
    vocab_size = shapes["token_embd.weight"][0]
    hidden = int(get("embedding_length", required=True))
    n_layers = int(get("block_count", required=True))
    n_heads = int(get("attention.head_count", required=True))
    ctx = int(get("context_length", 2048))
    common: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]], "model_type": arch, "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }  # fmt: skip
    if arch == "gpt2":
        return common | {
            "n_embd": hidden, "n_layer": n_layers, "n_head": n_heads, "n_positions": ctx, "n_ctx": ctx,
            "n_inner": int(get("feed_forward_length", 4 * hidden)),
            "layer_norm_epsilon": _f32(get("attention.layer_norm_epsilon", 1e-5)),
        }  # fmt: skip

    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ValueError("per-layer attention.head_count_kv is not supported")
    config = common | {
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": int(n_kv),
        # key_length is only written when head_dim != hidden / heads (e.g. Qwen3).
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": ctx, "hidden_act": "silu",
    }  # fmt: skip
    if arch in ("llama", "mistral"):
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    elif arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    # qwen2 always has q/k/v biases in HF; nothing to set.
    if (rope_scaling := _rope_scaling(get)) is not None:
        config["rope_scaling"] = rope_scaling
    if "rope_freqs.weight" in shapes:
        logger.warning("dropping rope_freqs.weight (llama3-style rope factors are not reconstructed)")
    return config


def _f32(value: Any) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest
    # float32 repr recovers the value that was written, which keeps config.json tidy.
    return float(str(np.float32(value)))


def _rope_scaling(get: Callable[[str, Any], Any]) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None)
    if kind in (None, "none") or factor is None:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": _f32(factor)}
    if (orig := get("rope.scaling.original_context_length", None)) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _unpermute_rotary(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """Undo convert_hf_to_gguf's q/k permutation for llama-family models.

    HF llama rotates each head as two halves (x[:d/2], x[d/2:]); ggml's "normal" rope
    rotates adjacent pairs (x[2i], x[2i+1]). llama.cpp's converter therefore reorders
    the output rows of q_proj/k_proj (weights and biases) within each head, taking
    row layout (2, d/2) to (d/2, 2). Here the inverse: (d/2, 2) -> (2, d/2).
    """

    def fn(w: np.ndarray) -> np.ndarray:
        half = w.shape[0] // n_head // 2
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return fn


def _plan_tensors(arch: str, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[_TensorPlan]:
    is_gpt2 = arch == "gpt2"
    block_names = _GPT2_BLOCK_NAMES if is_gpt2 else _LLAMA_BLOCK_NAMES
    global_names = _GPT2_GLOBAL_NAMES if is_gpt2 else _LLAMA_GLOBAL_NAMES
    block_prefix = "transformer.h" if is_gpt2 else "model.layers"
    # Only the llama family is stored permuted: qwen2/qwen3 use NEOX-style rope in
    # llama.cpp, which matches HF's half-split layout as is.
    permuted = arch in ("llama", "mistral")

    plans: list[_TensorPlan] = []
    for name, shape in shapes.items():
        if name in _SKIPPED_TENSORS:
            continue
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        transposed = False
        if m := _BLOCK_RE.match(name):
            layer, kind, suffix = m.groups()
            if kind not in block_names:
                raise ValueError(f"unexpected tensor {name!r} for architecture {arch!r}")
            hf = f"{block_prefix}.{layer}.{block_names[kind]}.{suffix}"
            if permuted and kind == "attn_q":
                transform = _unpermute_rotary(config["num_attention_heads"])
            elif permuted and kind == "attn_k":
                transform = _unpermute_rotary(config["num_key_value_heads"])
            elif is_gpt2 and kind in _GPT2_CONV1D and suffix == "weight":
                transform, shape, transposed = np.transpose, shape[::-1], True
        elif (m := _GLOBAL_RE.match(name)) and m.group(1) in global_names:
            hf = f"{global_names[m.group(1)]}.{m.group(2)}"
        else:
            raise ValueError(f"unexpected tensor {name!r} for architecture {arch!r}")
        plans.append(_TensorPlan(name, hf, shape, transform, transposed))
    return plans


def _kept_as_blocks(plan: _TensorPlan, tensor: _RawTensor) -> _TensorPlan:
    """The plan storing the tensor's raw blocks where it is a matrix of a kept type whose transform,
    if any, reorders whole rows."""
    if tensor.qtype.name not in KEPT_TYPES or len(plan.shape) != 2 or plan.transposed:
        return plan
    return dataclasses.replace(plan, blocks=(tensor.qtype.name, int(tensor.data.shape[-1])))


def _stored(tensor: _RawTensor, plan: _TensorPlan) -> np.ndarray:
    if plan.blocks is None:
        return _dequantize(tensor, plan)
    data = tensor.data.reshape(plan.stored_shape)  # uint8, one row of blocks per output row
    return np.ascontiguousarray(data if plan.transform is None else plan.transform(data))


def _dequantize(tensor: _RawTensor, plan: _TensorPlan) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.qtype)  # (..., bytes per row) -> (..., cols)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize {tensor.name} of type {tensor.qtype.name}: {e}") from e
    data = data.reshape(tensor.shape)
    if plan.transform is not None:
        data = plan.transform(data)
    return np.ascontiguousarray(data, dtype=np.float32)


def _write_safetensors(out: Path, plans: list[_TensorPlan], produce: Callable[[_TensorPlan], np.ndarray]) -> None:
    """Write the tensors with the safetensors library, in shards of at most _SHARD_BYTES (HF's
    sharded layout with an index when there is more than one), so peak memory is one shard."""
    from safetensors.numpy import save_file

    shards: list[list[_TensorPlan]] = [[]]
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


def _save_tokenizer(src: Path, out: Path) -> None:
    # transformers rebuilds a fast tokenizer (vocab, merges, special tokens, chat
    # template) from the GGUF metadata; saving it makes the folder self-contained.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(out))

