"""The projectors that turn a tower's states into rows of the language model's width, one per
mmproj projector type, and the one graph (tower + projector) a VisionModel compiles."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import opset1

from vinoserve.model.blocks import const, linear, rms_norm
from vinoserve.model.vision.mmproj import QWEN_PROJECTORS, MMProj
from vinoserve.model.vision.qwen_tower import build_qwen_stages
from vinoserve.model.vision.tower import build_tower, dense, weight


def _mlp(x: ov.Output, mm: MMProj) -> ov.Output:
    """LLaVA: the patches without CLS (the "default" feature strategy), then Linear-GELU-Linear.
    GELU in its exact (erf) form, as HF's projector_hidden_act "gelu"; llama.cpp uses tanh's."""
    if mm.has("v.class_embd"):
        x = ops.slice(x, const([1]), const([np.iinfo(np.int64).max]), const([1]), const([1])).output(0)
    x = ops.gelu(dense(x, mm, "mm.0"), approximation_mode="erf").output(0)
    return dense(x, mm, "mm.2") if mm.has("mm.2.weight") else x


def _gemma3(x: ov.Output, mm: MMProj) -> ov.Output:
    """Gemma 3: the patch grid average-pooled by the scale factor, RMS-normed (the file's weight
    already holds Gemma's 1 + w), then x @ input_projection ([vision width, text width])."""
    cfg = mm.config
    side, k = cfg.patches_per_side, cfg.scale_factor
    grid = ops.reshape(ops.transpose(x, const([0, 2, 1])), const([0, cfg.hidden_size, side, side]),
                       special_zero=True)
    pooled = opset1.avg_pool(grid, [k, k], [0, 0], [0, 0], [k, k], exclude_pad=True, rounding_type="floor")
    rows = ops.transpose(ops.reshape(pooled, const([0, cfg.hidden_size, -1]), special_zero=True), const([0, 2, 1]))
    normed = rms_norm(rows.output(0), mm.weight("mm.soft_emb_norm.weight").astype(np.float32), cfg.layer_norm_eps)
    return ops.matmul(normed, weight(mm.weight("mm.input_projection.weight")), False, False).output(0)


def _idefics3(x: ov.Output, mm: MMProj) -> ov.Output:
    """Idefics3 / SmolVLM: HF's pixel_shuffle (each s x s block of patches becomes one row of
    s^2 x width), then the linear `mm.model.fc` without bias."""
    cfg = mm.config
    side, s, width = cfg.patches_per_side, cfg.scale_factor, cfg.hidden_size
    y = ops.reshape(x, const([0, side, side // s, width * s]), special_zero=True)
    y = ops.transpose(y, const([0, 2, 1, 3]))
    y = ops.reshape(y, const([0, side // s, side // s, width * s * s]), special_zero=True)
    y = ops.transpose(y, const([0, 2, 1, 3]))
    y = ops.reshape(y, const([0, -1, width * s * s]), special_zero=True)
    return linear(y.output(0), weight(mm.weight("mm.model.fc.weight")))


PROJECT: dict[str, Callable[[ov.Output, MMProj], ov.Output]] = {
    "mlp": _mlp, "gemma3": _gemma3, "idefics3": _idefics3}


def projection_width(mm: MMProj) -> int:
    """The width of the rows the projector writes, from its last matrix."""
    shape = {"mlp": lambda: mm.weight("mm.2.weight" if mm.has("mm.2.weight") else "mm.0.weight").shape[0],
             "gemma3": lambda: mm.weight("mm.input_projection.weight").shape[1],
             "idefics3": lambda: mm.weight("mm.model.fc.weight").shape[0]}
    shape.update({qwen: lambda: mm.weight("mm.2.weight").shape[0] for qwen in QWEN_PROJECTORS})
    return int(shape[mm.config.projector]())


def build_vision_model(mm: MMProj) -> list[ov.Model]:
    """Input "pixel_values" [B, 3, S, S] f32 -> output "embeddings" [B, tokens, text width], one
    model; Qwen-VL's: the stages of build_qwen_stages."""
    if mm.config.dynamic:
        return build_qwen_stages(mm)
    size = mm.config.image_size
    pixels = ops.parameter([-1, 3, size, size], ov.Type.f32, name="pixel_values")
    pixels.output(0).set_names({"pixel_values"})
    out = ops.result(PROJECT[mm.config.projector](build_tower(pixels.output(0), mm), mm))
    out.output(0).set_names({"embeddings"})
    return [ov.Model([out], [pixels], f"vision-{mm.config.projector}")]
