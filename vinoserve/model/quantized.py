"""GGUF's quantized blocks as the integer groups OpenVINO's CPU plugin multiplies in its kernels.

Each ggml type maps to one layout (the table `LAYOUTS`): integers of an OpenVINO low-bit type in
groups along the input dimension, one scale per group, and for types that store a minimum per
block an offset per group (w = q * scale + offset): the file's own f16s, or f32 where they are
products or sums of stored numbers. The blocks are unpacked with vectorised numpy, a slice of
rows at a time, never through a float copy of the tensor.

| ggml type | kept as | exact? |
| --- | --- | --- |
| Q4_0 | i4 (q - 8), groups of 32 | yes: the block's own integers and f16 scale |
| Q8_0 | i8, groups of 32 | yes |
| Q5_0 | i8 (q - 16), groups of 32 | yes (no 5-bit type: 8 bits a weight) |
| Q6_K | i8 (q - 32), groups of 16, f32 scale d * sub-scale | yes (an f16 times an 8-bit integer fits f32) |
| Q4_1 | i4 (q - 8), groups of 32, f32 offset min + 8 d | yes (to f32's rounding of the sum) |
| Q5_1 | i8 (q - 16), groups of 32, f32 offset min + 16 d | likewise |
| Q4_K | i4 (q - 8), groups of 32, f32 scale d * sc, f32 offset 8 d * sc - dmin * m | likewise |
| Q5_K | i8 (q - 16), groups of 32, f32 scale d * sc, f32 offset 16 d * sc - dmin * m | likewise |
| MXFP4 | i8 (twice the e2m1 value, -12..12), groups of 32, f32 scale 2^(e - 128) | yes |

Types with a minimum are centred (q - 8, the min moved by 8 steps): the offset's product is
computed apart (block_offsets), and with the file's unsigned q every weight of a group leans one
way, so the main product is large and the offset's nearly cancels it. Any rounding of the input
(bf16, or the int8 activations of the decode model) then survives the cancellation: SmolLM2's
Q4_1 file with int8 activations in decode steps had 7% more perplexity uncentred, none centred
(benchmarks/results/2026-11-25-sapphire-rapids-gguf-blocks.md). Rounding d * sc to f16 (11 bits;
d has 11 and the sub-scale 6) moved a llama-quantize Q4_K_M's logits by up to 0.07 against
transformers' f32 reading of it, so the K-quants' products stay f32; the CPU plugin turns every
scale into f32 when it compiles a compressed matmul, so that costs the IR's size (+0.5 bit a
weight), not speed.

MXFP4 (gpt-oss' experts) has no exact 4-bit integer form (its values 0, 0.5, 1, 1.5, 2, 3, 4, 6 are
not evenly spaced). OpenVINO's f4e2m1 constant with an f8e8m0 scale is exact, but on 2026.4.1 the
CPU plugin decompressed the whole [E, N, K] tensor to f32 on every call in front of GatherMatmul
(a Convert and a Multiply, no GatherMatmulCompressed), so it is kept as i8 (llama.cpp's doubled
table, the scale halved to match) at 8 bits a weight plus 1 for the scale.

Other types (Q2_K, Q3_K, the IQ types, ...) are not kept: `Weights` dequantizes them.
Offsets do not fit the plugin's compressed-weight pattern; `block_offsets` moves them out of the
matrix at load time (a small second product with per-group sums of the input).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import openvino as ov
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES

_CHUNK_BYTES = 1 << 26  # raw bytes unpacked at a time: bounds the temporaries of a 500M-weight table


@dataclass(frozen=True)
class Blocks:
    """w[r, g * group + i] = q[r, g, i] * scale[r, g] (+ offset[r, g]). 4-bit `q` is packed two
    values a byte, the first in the low nibble (OpenVINO's u4/i4 layout): [rows, groups, group // 2]."""

    element: ov.Type  # u4, i4, u8 or i8
    q: np.ndarray  # uint8 (packed 4-bit, or u8) or int8
    scale: np.ndarray  # float16 or float32 [rows, groups, 1]
    offset: np.ndarray | None = None  # float32 [rows, groups, 1]

    @property
    def group(self) -> int:
        return self.q.shape[2] * (2 if self.element.bitwidth == 4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * self.group


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> float16 [..., 1]"""
    return np.ascontiguousarray(raw).view(np.float16)


def _pairs(q: np.ndarray) -> np.ndarray:
    """ggml's nibble order -> OpenVINO's. In a ggml 32-value run of 16 bytes, value i sits in the
    low nibble of byte i and value 16 + i in the high one; OpenVINO packs values 2k and 2k + 1
    into byte k. Returns [..., 16] packed bytes of the 32 values in order."""
    a, b = q[..., 0::2], q[..., 1::2]
    return np.concatenate([(a & 0x0F) | (b << 4), (a >> 4) | (b & 0xF0)], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit mask per block -> [..., count] bits (bit i of the little-endian word)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values in ggml's order (low nibbles, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(ov.Type.i4, _pairs(b[..., 2:]) ^ 0x88, _f16(b[..., :2]))  # ^ 0x88: q - 8 in two's complement


def _centred(element: ov.Type, q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Blocks:
    """Unsigned q * scale + offset as signed (q - half) * scale + (offset + half * scale), f32."""
    scale, offset = scale.astype(np.float32), offset.astype(np.float32)
    if element == ov.Type.i4:  # q ^ 8 is q - 8 in 4-bit two's complement, two nibbles a byte
        return Blocks(element, q ^ 0x88, scale, offset + 8 * scale)
    return Blocks(element, (q.astype(np.int8) - 16), scale, offset + 16 * scale)  # 5-bit values in i8


def _q4_1(b: np.ndarray) -> Blocks:
    return _centred(ov.Type.i4, _pairs(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]))


def _q5(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    return _low_nibbles(qs) | (_high_bits(qh, 32) << 4)


def _q5_0(b: np.ndarray) -> Blocks:
    q = (_q5(b[..., 6:], b[..., 2:6]).astype(np.int8) - 16)
    return Blocks(ov.Type.i8, q, _f16(b[..., :2]))


def _q5_1(b: np.ndarray) -> Blocks:
    return _centred(ov.Type.i8, _q5(b[..., 8:], b[..., 4:8]), _f16(b[..., :2]), _f16(b[..., 2:4]))


def _q8_0(b: np.ndarray) -> Blocks:
    return Blocks(ov.Type.i8, np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., :2]))


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-sub-block scale d * sc and offset -dmin * m, f32 [..., 8, 1]
    (exact: an f16 times a 6-bit integer)."""
    d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    s = b[..., 4:16]
    lo, hi, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return (d * sc.astype(np.float32))[..., None], (-dmin * m.astype(np.float32))[..., None]


def _q4_k(b: np.ndarray) -> Blocks:
    # 128 bytes of values: 4 runs of 32 bytes, run c holds sub-block 2c in its low nibbles and
    # 2c + 1 in its high ones, each in order.
    runs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
    a, c = runs[..., 0::2], runs[..., 1::2]
    q = np.stack([(a & 0x0F) | (c << 4), (a >> 4) | (c & 0xF0)], axis=-2)  # [..., 4, 2, 16]
    scale, offset = _k_scales(b)
    return _centred(ov.Type.i4, q.reshape(*b.shape[:-1], 8, 16), scale, offset)


def _q5_k(b: np.ndarray) -> Blocks:
    runs = b[..., 48:].reshape(*b.shape[:-1], 4, 32)
    low = np.stack([runs & 0x0F, runs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    # qh: 32 bytes; bit j of byte i is the fifth bit of value i of sub-block j.
    qh = b[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    scale, offset = _k_scales(b)
    return _centred(ov.Type.i8, low | (high << 4), scale, offset)


def _q6_k(b: np.ndarray) -> Blocks:
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 2, 4, 32)  # runs of 32 per half
    high = (qh[..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    q = ((low | (high << 4)).astype(np.int8) - 32).reshape(*lead, 16, 16)
    sub = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)
    return Blocks(ov.Type.i8, q, (d * sub)[..., None])


_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # ggml's kvalues_mxfp4


def _mxfp4(b: np.ndarray) -> Blocks:
    # An E8M0 byte e is 2^(e - 127); the values are doubled, so the scale is 2^(e - 128), an f32
    # (subnormal for e < 2, as ggml's e8m0_to_fp32_half makes it).
    scale = np.ldexp(np.float32(1), b[..., :1].astype(np.int32) - 128).astype(np.float32)
    return Blocks(ov.Type.i8, _MXFP4_VALUES[_low_nibbles(b[..., 1:])], scale)


# ggml type -> unpacker of raw blocks [rows, blocks, bytes per block] into one group layout.
LAYOUTS: dict[T, Callable[[np.ndarray], Blocks]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.MXFP4: _mxfp4,
}


def _row_slices(rows: int, row_bytes: int) -> Iterator[slice]:
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def unpack(ggml_type: T, raw: np.ndarray) -> Blocks:
    """Raw blocks uint8 [rows, bytes per row] of a type in LAYOUTS -> its Blocks, a slice of rows
    at a time into arrays of the final size."""
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    rows, row_bytes = raw.shape
    blocks = raw.reshape(rows, row_bytes // block_bytes, block_bytes)
    unpacker = LAYOUTS[ggml_type]
    out: Blocks | None = None
    for s in _row_slices(rows, row_bytes):
        part = unpacker(blocks[s])
        part = Blocks(part.element, *(a.reshape(s.stop - s.start, -1, a.shape[-1]) if a is not None else None
                                      for a in (part.q, part.scale, part.offset)))
        if out is None:
            out = Blocks(part.element, *(np.empty((rows, *a.shape[1:]), a.dtype) if a is not None else None
                                         for a in (part.q, part.scale, part.offset)))
        for dst, src in zip((out.q, out.scale, out.offset), (part.q, part.scale, part.offset)):
            if dst is not None:
                dst[s] = src
    assert out is not None and out.shape[1] == row_bytes // block_bytes * block_values
    return out
