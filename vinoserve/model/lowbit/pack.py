"""The kernel's weight layout (lowbit_matmul.cpp): rows in tiles of 16, per tile and group the
64-byte chunks one VNNI dot product reads (16 rows x 4 consecutive weights), and the per-row
scales of a tile and group side by side."""
from __future__ import annotations

import numpy as np

TILE = 16
_ROWS_AT_ONCE = 4096  # bounds the padded and transposed copies of a large matrix (not `unsigned`'s input)


def unsigned(packed: np.ndarray, rows: int, k: int, bits: int, signed: bool) -> np.ndarray:
    """An OpenVINO constant's bytes (4-bit: values 2j and 2j + 1 in the low and high nibble of
    byte j) -> uint8 [rows, k] with the sign bias added (i4 + 8, i8 + 128)."""
    data = np.frombuffer(packed, dtype=np.uint8) if not isinstance(packed, np.ndarray) else packed.view(np.uint8)
    if bits == 4:
        data = data.reshape(rows, k // 2)
        if signed:
            data = data ^ 0x88
        return np.stack([data & 0x0F, data >> 4], axis=-1).reshape(rows, k)
    data = data.reshape(rows, k)
    return data ^ 0x80 if signed else data


def pack_weights(u: np.ndarray, bits: int, group: int) -> np.ndarray:
    """uint8 [rows, k] (values < 2**bits) -> the tiled bytes, rows padded to a multiple of 16."""
    parts = [_pack_rows(u[r:r + _ROWS_AT_ONCE], bits, group) for r in range(0, u.shape[0], _ROWS_AT_ONCE)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _pack_rows(u: np.ndarray, bits: int, group: int) -> np.ndarray:
    rows, k = u.shape
    tiles = -(-rows // TILE)
    u = np.pad(u, ((0, tiles * TILE - rows), (0, 0)))
    quads = group // 4
    # [tile, row, group, quad, 4] -> [tile, group, quad, row, 4]
    t = u.reshape(tiles, TILE, k // group, quads, 4).transpose(0, 2, 3, 1, 4)
    if bits == 4:
        half = quads // 2
        t = t[:, :, :half] | (t[:, :, half:] << 4)
    return np.ascontiguousarray(t).reshape(-1)


def pack_floats(x: np.ndarray) -> np.ndarray:
    """[rows, groups] -> [tiles, groups, 16], rows padded with zeros."""
    rows, groups = x.shape
    tiles = -(-rows // TILE)
    x = np.pad(x, ((0, tiles * TILE - rows), (0, 0)))
    return np.ascontiguousarray(x.reshape(tiles, TILE, groups).transpose(0, 2, 1))
