"""Read and rewrite whole key-cache blocks on the host, for every cache precision the CPU plugin
uses: f32, f16, bf16, and u8/u4 quantized by channel (per-block scale and zero point per channel)
or by token (per-row scale and zero point). Values come out and go in as float32."""
from __future__ import annotations

import numpy as np
import openvino as ov

_PARAMS = 8  # bytes of (f32 scale, f32 zero point) per quantization group


class KeyCodec:
    def __init__(self, tensor: ov.Tensor, heads: int, block: int, head_size: int) -> None:
        self.tensor, self.heads, self.block, self.head_size = tensor, heads, block, head_size
        self.num_blocks = tensor.get_shape()[0]

    @staticmethod
    def for_tensor(tensor: ov.Tensor, block: int, head_size: int) -> KeyCodec:
        t, shape = tensor.get_element_type(), tuple(tensor.get_shape())
        heads = shape[1]
        if t in (ov.Type.f32, ov.Type.f16):
            return _Float(tensor, heads, block, head_size)
        if t == ov.Type.bf16:
            return _BF16(tensor, heads, block, head_size)
        bits = {ov.Type.u8: 8, ov.Type.u4: 4}.get(t)
        if bits is None:
            raise ValueError(f"no host key codec for {t.get_type_name()} caches")
        by_channel = shape[2] != block  # extra rows of per-channel params in the token dim
        return (_ByChannel if by_channel else _ByToken)(tensor, heads, block, head_size, bits)

    def read(self, blocks: np.ndarray) -> np.ndarray:
        """[R, heads, block, head_size] float32."""
        raise NotImplementedError

    def write(self, blocks: np.ndarray, keys: np.ndarray, valid: np.ndarray) -> None:
        """Store keys [R, heads, block, head_size]; only the first valid[r] tokens of a block count."""
        raise NotImplementedError


class _Float(KeyCodec):
    def read(self, blocks):
        return self.tensor.data[blocks].astype(np.float32)

    def write(self, blocks, keys, valid):
        self.tensor.data[blocks] = keys.astype(self.tensor.data.dtype)


class _BF16(KeyCodec):
    # numpy has no bfloat16: work on the raw 16 bits (the top half of a float32).
    def read(self, blocks):
        bits = self.tensor.data.view(np.uint16)[blocks].astype(np.uint32) << 16
        return bits.view(np.float32)

    def write(self, blocks, keys, valid):
        u = np.ascontiguousarray(keys, dtype=np.float32).view(np.uint32)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        self.tensor.data.view(np.uint16)[blocks] = rounded.astype(np.uint16)


class _Quantized(KeyCodec):
    def __init__(self, tensor, heads, block, head_size, bits: int) -> None:
        super().__init__(tensor, heads, block, head_size)
        self.bits, self.levels = bits, (1 << bits) - 1
        self.raw = tensor.data.reshape(self.num_blocks, heads, -1)  # bytes of one (block, head)

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        if self.bits == 8:
            return packed.astype(np.float32)
        high, low = packed >> 4, packed & 0x0F  # element 2i in the high nibble (measured)
        return np.stack([high, low], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)

    def _pack(self, q: np.ndarray) -> np.ndarray:
        q = q.astype(np.uint8)
        if self.bits == 8:
            return q
        pairs = q.reshape(*q.shape[:-1], -1, 2)
        return (pairs[..., 0] << 4) | pairs[..., 1]

    def _quantize(self, x: np.ndarray, axis: int, valid_mask: np.ndarray | None):
        """Asymmetric min/max over `axis` (only valid tokens), as the plugin does."""
        if valid_mask is None:
            lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
        else:
            lo = np.where(valid_mask, x, np.inf).min(axis=axis, keepdims=True)
            hi = np.where(valid_mask, x, -np.inf).max(axis=axis, keepdims=True)
        scale = (hi - lo) / self.levels
        scale = np.where(scale == 0, 1e-8, scale).astype(np.float32)  # a constant channel
        zp = (-lo / scale).astype(np.float32)
        q = np.clip(np.round(x / scale + zp), 0, self.levels)
        return q, scale, zp


class _ByChannel(_Quantized):
    """Per (block, head): f32 scale[S], f32 zero_point[S], then block x S quantized values."""

    def read(self, blocks):
        raw = self.raw[blocks]
        S = self.head_size
        scale = raw[..., :4 * S].copy().view(np.float32)[..., None, :]
        zp = raw[..., 4 * S:_PARAMS * S].copy().view(np.float32)[..., None, :]
        q = self._unpack(raw[..., _PARAMS * S:]).reshape(*raw.shape[:2], self.block, S)
        return (q - zp) * scale

    def write(self, blocks, keys, valid):
        S = self.head_size
        mask = (np.arange(self.block)[None, None, :, None] < valid[:, None, None, None])
        q, scale, zp = self._quantize(keys, axis=2, valid_mask=np.broadcast_to(mask, keys.shape))
        q = np.where(mask, q, 0)
        raw = np.concatenate([scale.reshape(*keys.shape[:2], S).view(np.uint8),
                              zp.reshape(*keys.shape[:2], S).view(np.uint8),
                              self._pack(q).reshape(*keys.shape[:2], -1)], axis=-1)
        self.raw[blocks] = raw


class _ByToken(_Quantized):
    """Per (block, head, token) row: f32 scale, f32 zero point, then S quantized values."""

    def _rows(self, blocks):
        return self.raw[blocks].reshape(len(blocks), self.heads, self.block, -1)

    def read(self, blocks):
        rows = self._rows(blocks)
        scale = rows[..., 0:4].copy().view(np.float32)
        zp = rows[..., 4:8].copy().view(np.float32)
        return (self._unpack(rows[..., _PARAMS:]) - zp) * scale

    def write(self, blocks, keys, valid):
        q, scale, zp = self._quantize(keys, axis=3, valid_mask=None)
        rows = np.concatenate([scale.view(np.uint8), zp.view(np.uint8), self._pack(q)], axis=-1)
        self.raw[blocks] = rows.reshape(len(blocks), self.heads, -1)
