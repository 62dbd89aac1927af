"""Weight matrices as graph constants, in the chosen weight format.

Each matrix arrives as the file holds it (a `GGUFTensor`: blocks of some ggml type, or plain
floats) and leaves as an ov.Output of f32 values, compressed in the graph as the format says, in
the decompression pattern (Constant -> Convert -> [Subtract] -> Multiply) that the CPU plugin
fuses into its matmuls.
"""
from __future__ import annotations

from typing import Literal

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.gguf_loader import GGUFTensor

WeightFormat = Literal["f32", "f16", "int8"]
WEIGHT_FORMATS: tuple[str, ...] = ("f32", "f16", "int8")

_Q8_BLOCK = 32  # GGUF's Q8_0: 32 int8 values share one f16 scale


def _const(value, dtype=np.int64) -> ov.Output:
    return ops.constant(np.asarray(value, dtype=dtype)).output(0)


class Weights:
    """Turns file tensors into compact constants that decompress to f32 inside the graph."""

    def __init__(self, fmt: WeightFormat) -> None:
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {fmt!r}; supported: {', '.join(WEIGHT_FORMATS)}")
        self.fmt = fmt

    def matrix(self, t: GGUFTensor, name: str) -> ov.Output:
        w = t.dequantize()
        if self.fmt == "f32":
            return ops.constant(w.astype(np.float32), name=name).output(0)
        if self.fmt == "f16":
            c = ops.constant(w.astype(np.float16), name=name)
            return ops.convert(c, ov.Type.f32).output(0)
        return self._int8(w, name)

    def table(self, t: GGUFTensor, name: str) -> ov.Output:
        """The token table, or an untied LM head. In f16, one that is 8-bit blocks (GGUF's Q8_0, as
        llama.cpp commonly ships it) stays so rather than widen: the same values in half the bytes,
        and the LM head reads all of it every decode step (SmolLM2: 57 of the 262 MB a step streams;
        one-sequence decode 7% faster). int8 requantizes it per row like its layers: as exact
        blocks it decoded 2-4% slower there, at the same perplexity. f32 stays plain f32
        arithmetic, the reference."""
        if self.fmt != "f16" or t.ggml_type != gguf.GGMLQuantizationType.Q8_0:
            return self.matrix(t, name)
        q, scale = _q8_blocks(t)
        x = ops.multiply(ops.convert(ops.constant(q, name=name), ov.Type.f16), ops.constant(scale, name=f"{name}/scale"))
        return ops.convert(ops.reshape(x, _const(t.shape), special_zero=False), ov.Type.f32).output(0)

    def _int8(self, w: np.ndarray, name: str) -> ov.Output:
        # Asymmetric per-output-row u8, the pattern OpenVINO's CPU/GPU plugins fuse into matmuls.
        # The range must contain 0 so the zero point is representable; quantize with the f16
        # scale the graph will hold, not the f32 one.
        lo = np.minimum(w.min(axis=1, keepdims=True), 0.0)
        hi = np.maximum(w.max(axis=1, keepdims=True), 0.0)
        scale = (np.maximum(hi - lo, 1e-6) / 255.0).astype(np.float16)
        s32 = scale.astype(np.float32)
        zp = np.clip(np.round(-lo / s32), 0, 255)
        q = np.clip(np.round(w / s32) + zp, 0, 255).astype(np.uint8)
        qc = ops.convert(ops.constant(q, name=name), ov.Type.f16)
        zc = ops.convert(ops.constant(zp.astype(np.uint8), name=f"{name}/zero_point"), ov.Type.f16)
        sc = ops.constant(scale, name=f"{name}/scale")
        return ops.convert(ops.multiply(ops.subtract(qc, zc), sc), ov.Type.f32).output(0)


def _q8_blocks(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's own blocks: int8 [rows, K/32, 32] and f16 scales [rows, K/32, 1]. A block
    is 34 bytes, its f16 scale first."""
    rows, k = t.shape
    blocks = t.data.reshape(rows, k // _Q8_BLOCK, 2 + _Q8_BLOCK)
    scale = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)
    return q, scale
