"""Tensors encoded as a GGUF file stores them, for the tests' writers (gguf_writer.py): gguf-py's
quantizer where it has one, simple Q4_K / Q5_K / Q6_K quantizers where it has none (close to the
data, not llama.cpp's search), and random blocks with sane scales for the other K-quants."""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

_K_FP16_FIELDS = {QT.Q2_K: (-4, -2), QT.Q3_K: (-2,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (-2,)}


def encode_weights(data: np.ndarray, qtype: QT, rng: np.random.Generator) -> tuple[np.ndarray, QT]:
    """Data to store for one tensor. 1-D tensors and rows that do not fit the block size stay
    F32, as llama.cpp does. gguf-py cannot quantize K-quants: Q4_K, Q5_K and Q6_K are quantized here
    (simply, not llama.cpp's search, but close to the data); the other K-quants get random blocks
    with sane fp16 scales, which exercise dequantization and reshaping, not accuracy."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == QT.F32 or data.ndim == 1 or data.shape[-1] % block:
        return data.astype(np.float32), QT.F32
    if qtype == QT.F16:
        return data.astype(np.float16), QT.F16
    if qtype in _K_QUANTIZERS:
        return _K_QUANTIZERS[qtype](data.reshape(-1, 256)).reshape(*data.shape[:-1], -1), qtype
    if qtype not in _K_FP16_FIELDS:
        return gguf.quants.quantize(data, qtype), qtype
    n_blocks = data.size // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in _K_FP16_FIELDS[qtype]:  # overwrite the fp16 scales so no block is inf/nan
        raw[:, offset : offset + 2 or None] = np.full((n_blocks, 1), 0.01, dtype=np.float16).view(np.uint8)
    return raw.reshape(*data.shape[:-1], -1), qtype


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _k_sub_blocks(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, 256] -> (d, dmin and the 12 scale bytes [blocks, 16], q [blocks, 8, 32] in 0..top): 8
    sub-blocks of 32, w = (d * sc) * q - dmin * mn, 6-bit sc, mn (Q4_K's and Q5_K's shared part)."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # each sub-block's offset, stored as -dmin * mn with mn >= 0
    step = (sub.max(-1) - low) / top
    d = (np.maximum(step.max(-1), 1e-8) / 63).astype(np.float16).astype(np.float32)
    dmin = (np.maximum(-low.min(-1), 1e-8) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / (d[:, None] * sc)[..., None]), 0, top)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales], axis=1), q.astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """q [blocks, 8, 32] -> [blocks, 128]: sub-blocks 2p and 2p + 1 in the low and high nibbles of bytes 32p.."""
    q = q.reshape(-1, 4, 2, 32) & 15
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> Q4_K blocks: d, dmin, scales, 4-bit q."""
    head, q = _k_sub_blocks(x, 15)
    return np.concatenate([head, _nibble_pairs(q)], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> Q5_K blocks: d, dmin, scales, qh (bit s of byte l: sub-block s's weight l's
    fifth bit), then the low 4 bits as Q4_K's."""
    head, q = _k_sub_blocks(x, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    return np.concatenate([head, qh, _nibble_pairs(q)], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> Q6_K blocks: 16 groups of 16, w = (d * scale) * (q - 32), int8 scales."""
    group = x.reshape(-1, 16, 16)
    step = np.abs(group).max(-1) / 31
    d = np.maximum(step.max(-1) / 127, 1e-10).astype(np.float16).astype(np.float32)
    scale = np.clip(np.round(step / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(group / (d[:, None] * scale)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # half, quarter t, lane l
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scale.view(np.uint8), _fp16_bytes(d)], axis=1)


_K_QUANTIZERS = {QT.Q4_K: _quantize_q4_k, QT.Q5_K: _quantize_q5_k, QT.Q6_K: _quantize_q6_k}
