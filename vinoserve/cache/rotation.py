"""RoPE re-rotation of cached keys whose blocks moved to lower positions after an eviction.

A key cached at position p carries the phase p * w_j; after its block moves down by d tokens it
must carry (p - d) * w_j, i.e. be rotated by -d * w_j. Shifts are whole blocks, so one table row
per block multiple serves every rotation: row r = [cos(r*B*w_j) ..., -sin(r*B*w_j) ...] with the
model's own inverse frequencies w_j. Deltas are row indices, shaped [R, 1] (one per block) or
[R, B] (one per token).

Two appliers: the PagedAttention kernel (fed the table and per-layer block ids with the next
step, where the CPU kernel supports it: f32 compute, f32/f16 cache) and the host (numpy rewrites
the blocks in place at once: any cache precision, quantized ones requantized with fresh params).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from vinoserve.cache.key_codec import KeyCodec


class RotationTable:
    """cos/-sin rows for block-multiple shifts, grown on demand (a long prefill can be evicted
    by many blocks at once, so no fixed size is right)."""

    def __init__(self, inv_freq: np.ndarray, block_size: int, rows: int = 64) -> None:
        self.inv_freq = np.asarray(inv_freq, dtype=np.float64)
        self.block_size = block_size
        self.table = self._rows(0, rows)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        angles = (np.arange(start, stop, dtype=np.float64) * self.block_size)[:, None] * self.inv_freq[None, :]
        return np.concatenate([np.cos(angles), -np.sin(angles)], axis=1).astype(np.float32)

    def ensure(self, max_row: int) -> None:
        if max_row >= len(self.table):
            grow = max(max_row + 1, 2 * len(self.table))
            self.table = np.concatenate([self.table, self._rows(len(self.table), grow)])


@dataclass(frozen=True)
class LayerRotation:
    """Blocks of one layer to rotate: physical ids [R] and table rows [R, 1] or [R, B]."""

    blocks: np.ndarray
    deltas: np.ndarray
    valid_tokens: np.ndarray  # tokens in use per block (quantized blocks requantize only those)


def rotate(keys: np.ndarray, table: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """keys [R, H, B, S] float32, rotate-half pairing; deltas [R, 1] or [R, B] table rows."""
    half = keys.shape[-1] // 2
    rows = table[deltas]  # [R, 1|B, S]
    cos, nsin = rows[:, None, :, :half], rows[:, None, :, half:]
    x1, x2 = keys[..., :half], keys[..., half:]
    return np.concatenate([x1 * cos - x2 * nsin, x2 * cos + x1 * nsin], axis=-1)


class HostRotator:
    """Rewrites key blocks in place with numpy, exactly once, right after the eviction."""

    def __init__(self, key_caches: list[ov.Tensor], block_size: int, head_size: int) -> None:
        self.codecs = [KeyCodec.for_tensor(t, block_size, head_size) for t in key_caches]

    def apply(self, layer: int, rotation: LayerRotation, table: RotationTable) -> None:
        codec = self.codecs[layer]
        keys = codec.read(rotation.blocks)
        codec.write(rotation.blocks, rotate(keys, table.table, rotation.deltas), rotation.valid_tokens)


def kernel_supports_rotation(inference_precision: str | None, key_precision: str | None) -> bool:
    """Measured on the 2026.4 CPU plugin: in-kernel rotation is exact at f32/f32, ~2.5e-4 at
    f32/f16; refused or heap-corrupting everywhere else (bf16 compute, bf16/u8/u4 caches).
    Both must be known before compiling, so unset (device default) precisions count as unsafe."""
    return inference_precision == "f32" and key_precision in ("f32", "f16")
