"""A small numpy encoder for GGUF's K-quants (Q4_K, Q5_K, Q6_K), for test fixtures and the
benchmarks' random Q4_K_M models (random_models.py).

gguf-py dequantizes these types but cannot write them. This is no match for llama.cpp's
quantizer (no search for the best scales; plain min/max per sub-block), only a faithful writer
of the block layout, checked against gguf-py's `dequantize` in test_quantized_weights.py.

`exact_scales` rounds each super-block's d and dmin up to a few significant bits so that
d * sub-scale is exactly an f16: the graph keeps that product as one f16 scale per group, and a
fixture written so lets a test compare logits exactly. Without it, the products round to f16
(2^-11 relative), as they do for real files.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float [n] -> uint8 [n, 2]"""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _round_up_to_bits(x: np.ndarray, bits: int) -> np.ndarray:
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.ceil(mantissa * 2 ** bits) / 2 ** bits, exponent)


def _super_scale(values: np.ndarray, top: int, exact_bits: int | None) -> np.ndarray:
    """Per super-block scale of non-negative sub-block values, so value / scale <= top; then f16."""
    d = values.max(axis=-1) / top
    if exact_bits:
        d = _round_up_to_bits(d, exact_bits)
    return d.astype(np.float16).astype(np.float32)


def _sub_ints(values: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.round(values / d[:, None]), 0)
    return np.clip(q, -top, top)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sub-scales and mins [n, 8] -> ggml's 12 packed bytes [n, 12] (get_scale_min's inverse)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=1)


def _min_blocks(x: np.ndarray, levels: int, exact: bool):
    """Q4_K/Q5_K: sub-blocks of 32 as x ~ d * sc * q - dmin * m, q in 0..levels."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - lo) / levels
    d = _super_scale(scale, 63, 5 if exact else None)
    dmin = _super_scale(-lo, 63, 5 if exact else None)
    sc, m = _sub_ints(scale, d, 63), _sub_ints(-lo, dmin, 63)
    step = (d[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.round((sub + (dmin[:, None] * m)[..., None]) / step), 0)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m)], axis=1)
    return head, np.clip(q, 0, levels).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values 0..15 -> [n, 128] bytes: run c holds sub-block 2c low, 2c + 1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)


def q4_k(x: np.ndarray, exact_scales: bool = False) -> np.ndarray:
    head, q = _min_blocks(x, 15, exact_scales)
    return np.concatenate([head, _nibbles(q)], axis=1)


def q5_k(x: np.ndarray, exact_scales: bool = False) -> np.ndarray:
    head, q = _min_blocks(x, 31, exact_scales)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)  # [n, 32]
    return np.concatenate([head, qh, _nibbles(q & 0x0F)], axis=1)


def q6_k(x: np.ndarray, exact_scales: bool = False) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _super_scale(scale, 127, 4 if exact_scales else None)
    sc = _sub_ints(scale, d, 127)
    step = (d[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.round(sub / step), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128, rows of 32
    ql = np.concatenate([(q[:, :, r] & 0x0F) | ((q[:, :, r + 2] & 0x0F) << 4) for r in (0, 1)], axis=-1)
    qh = sum(((q[:, :, r] >> 4) & 3) << (2 * r) for r in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1)


ENCODERS = {T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k}


def quantize(x: np.ndarray, qtype: T, exact_scales: bool = False) -> np.ndarray:
    """float [rows, cols] (cols a multiple of 256) -> raw blocks uint8 [rows, bytes per row]."""
    rows, cols = x.shape
    assert cols % QK == 0, f"K-quants need rows of a multiple of {QK} values, not {cols}"
    blocks = ENCODERS[qtype](np.asarray(x, np.float32).reshape(-1, QK), exact_scales)
    return blocks.reshape(rows, -1)
