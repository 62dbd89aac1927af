"""Weight matrices as graph constants, in the chosen weight format.

Each matrix arrives as the file holds it (a `GGUFTensor`: blocks of some ggml type, or plain
floats) and leaves as an ov.Output of f32 values, compressed in the graph in the decompression
pattern (Constant -> Convert -> [Subtract] -> Multiply -> [Reshape]) that the CPU plugin fuses into
its matmuls. Formats:

- `auto` (the default): a quantized tensor keeps its own integers and scales in the layout
  quantized.py maps its type to; float tensors and the types without a layout become f16.
- `int4`: every matrix as i4 groups of 32 with an f16 scale (the Q4_0 layout, requantized from
  the file's values where they are not Q4_0 already); token table and LM head at 8 bits.
- `int8`: per-output-row u8 with a zero point. `f16`, `f32`: plain floats (f32 is the reference
  for exact comparisons).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Literal

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import quantized
from vinoserve.model.constant_store import ConstantStore, in_memory_constant
from vinoserve.model.gguf_file import GGUFTensor
from vinoserve.model.moe import ExpertMatrices
from vinoserve.model.quantized import Blocks

WeightFormat = Literal["auto", "int4", "int8", "f16", "f32"]
WEIGHT_FORMATS: tuple[str, ...] = ("auto", "int4", "int8", "f16", "f32")

_T = gguf.GGMLQuantizationType
# Rows dequantized at a time when requantizing (int4, int8): bounds the f32 temporaries, which for
# a whole 8B token table would be 2.1 GB each.
_ROWS_PER_REQUANT = 4096


def _const(value, dtype=np.int64) -> ov.Output:
    return ops.constant(np.asarray(value, dtype=dtype)).output(0)


class Weights:
    """Turns file tensors into compact constants that decompress to f32 inside the graph. With a
    `store`, the constants live in its file rather than in memory (conversion of large models)."""

    def __init__(self, fmt: WeightFormat, store: ConstantStore | None = None) -> None:
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {fmt!r}; supported: {', '.join(WEIGHT_FORMATS)}")
        self.fmt = fmt
        self.store = store

    @classmethod
    def of(cls, fmt: WeightFormat | Weights) -> Weights:
        return fmt if isinstance(fmt, Weights) else cls(fmt)

    def matrix(self, t: GGUFTensor, name: str) -> ov.Output:
        if self.fmt == "auto" and t.ggml_type in quantized.LAYOUTS:
            return self._blocks(quantized.unpack(t.ggml_type, t.data), name)
        if self.fmt == "int4":
            return self._blocks(_requantize(t, _T.Q4_0), name)
        if self.fmt == "int8":
            return self._int8(t, name)
        return self._float(t.dequantize(), name)

    def table(self, t: GGUFTensor, name: str) -> ov.Output:
        """The token table, or an untied LM head (read whole at every decode step).

        `auto` keeps the file's blocks as for any matrix. `int4` keeps a table that is already
        8 bits or fewer in its own layout and makes a float one Q8_0 (i8 groups of 32). `f16`
        keeps a Q8_0 table as its int8 blocks rather than widen it (llama.cpp's usual table:
        the same values in half the bytes; SmolLM2's one-sequence decode 7% faster). `int8`
        requantizes it per row like its layers (as exact blocks it decoded 2-4% slower, at the
        same perplexity). `f32` stays plain f32 arithmetic, the reference."""
        if self.fmt == "int4":
            if t.ggml_type in quantized.LAYOUTS:
                return self._blocks(quantized.unpack(t.ggml_type, t.data), name)
            return self._blocks(_requantize(t, _T.Q8_0), name)
        if self.fmt == "f16" and t.ggml_type == _T.Q8_0:
            return self._blocks(quantized.unpack(t.ggml_type, t.data), name)
        return self.matrix(t, name)

    def experts(self, t: GGUFTensor, name: str) -> ExpertMatrices:
        """A GGUF `*_exps` tensor (ggml {K, N, E}: [E, N, K], every expert's matrix) as one
        [E, N, K] output in the same layouts as `matrix`, except that `int8` takes Q8_0's
        symmetric groups of 32 (one block layout for every expert chain, and no coarser than
        per-row u8) and a block minimum is handed apart as `offsets` (moe.py adds its product)."""
        count, rows, cols = t.shape
        flat = replace(t, data=t.data.reshape(count * rows, -1), shape=(count * rows, cols))
        if self.fmt == "auto" and t.ggml_type in quantized.LAYOUTS:
            b = quantized.unpack(t.ggml_type, flat.data)
        elif self.fmt in ("int4", "int8"):
            b = _requantize(flat, _T.Q4_0 if self.fmt == "int4" else _T.Q8_0)
        else:
            return ExpertMatrices(self._float(t.dequantize(), name))
        lead = (count, rows)
        blocks = Blocks(b.element, *(a.reshape(*lead, *a.shape[1:]) for a in (b.q, b.scale)))
        offsets = None if b.offset is None else \
            self._constant(b.offset.reshape(*lead, -1).astype(np.float32), name=f"{name}/offset").output(0)
        return ExpertMatrices(self._blocks(blocks, name, t.shape), offsets)

    def _constant(self, data: np.ndarray, element: ov.Type | None = None, name: str | None = None) -> ov.Node:
        if self.store is not None:
            return self.store.constant(data, element, name)
        return in_memory_constant(data, element, name)

    def _blocks(self, b: Blocks, name: str, shape: tuple[int, ...] | None = None) -> ov.Output:
        """q -> Convert(scale's type) -> Multiply(scale) [-> Add(offset)] -> Reshape `shape` (by
        default [rows, K]) -> Convert(f32). The Add is not the plugin's pattern: block_offsets
        splits it off at load time."""
        q = self._constant(b.q, b.element, name)
        wide = ov.Type.f32 if b.scale.dtype == np.float32 else ov.Type.f16
        x = ops.multiply(ops.convert(q, wide), self._constant(b.scale, name=f"{name}/scale"))
        if b.offset is not None:
            x = ops.add(x, self._constant(b.offset, name=f"{name}/offset"))
        x = ops.reshape(x, _const(shape or b.shape), special_zero=False)
        return ops.convert(x, ov.Type.f32).output(0)

    def _float(self, w: np.ndarray, name: str) -> ov.Output:
        if self.fmt == "f32":
            return self._constant(w.astype(np.float32), name=name).output(0)
        return ops.convert(self._constant(w.astype(np.float16), name=name), ov.Type.f32).output(0)

    def _int8(self, t: GGUFTensor, name: str) -> ov.Output:
        """Asymmetric per-output-row u8, the pattern OpenVINO's CPU/GPU plugins fuse into matmuls;
        rows are independent, so a slice of rows at a time gives the same bytes."""
        rows = t.shape[0]
        q, zp, scale = np.empty(t.shape, np.uint8), np.empty((rows, 1), np.uint8), np.empty((rows, 1), np.float16)
        for s, w in _row_chunks(t):
            q[s], zp[s], scale[s] = _int8_rows(w)
        qc = ops.convert(self._constant(q, name=name), ov.Type.f16)
        zc = ops.convert(self._constant(zp, name=f"{name}/zero_point"), ov.Type.f16)
        sc = self._constant(scale, name=f"{name}/scale")
        return ops.convert(ops.multiply(ops.subtract(qc, zc), sc), ov.Type.f32).output(0)


def _int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u8 values, zero point and f16 scale of each row of `w`. The range must contain 0 so the
    zero point is representable; values are quantized with the f16 scale the graph will hold,
    not the f32 one."""
    lo = np.minimum(w.min(axis=1, keepdims=True), 0.0)
    hi = np.maximum(w.max(axis=1, keepdims=True), 0.0)
    scale = (np.maximum(hi - lo, 1e-6) / 255.0).astype(np.float16)
    s32 = scale.astype(np.float32)
    zp = np.clip(np.round(-lo / s32), 0, 255)
    q = np.clip(np.round(w / s32) + zp, 0, 255).astype(np.uint8)
    return q, zp.astype(np.uint8), scale


def _requantize(t: GGUFTensor, target: gguf.GGMLQuantizationType) -> Blocks:
    """`t` in `target`'s layout: its own blocks if it is `target` already, else its values
    quantized by gguf-py (llama.cpp's rounding), a slice of rows at a time."""
    if t.ggml_type == target:
        return quantized.unpack(target, t.data)
    return quantized.unpack(target, np.concatenate([gguf.quants.quantize(w, target) for _, w in _row_chunks(t)]))


def _row_chunks(t: GGUFTensor) -> Iterator[tuple[slice, np.ndarray]]:
    """`t`'s rows as f32 values, a slice of rows at a time (rows are whole quant blocks)."""
    for start in range(0, t.shape[0], _ROWS_PER_REQUANT):
        s = slice(start, min(t.shape[0], start + _ROWS_PER_REQUANT))
        yield s, t.rows(s.start, s.stop).dequantize()
