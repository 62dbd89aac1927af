"""Qwen2-VL / Qwen2.5-VL's vision side of an `optimum-cli export openvino --task image-text-to-text`
directory as a VisionModel. optimum-intel 2.1 splits HF's tower in two: openvino_vision_embeddings_model.xml
(the patch convolution: HF's pixel_values rows -> states) and openvino_vision_embeddings_merger_model.xml
(the layers and merger), which takes what HF's Qwen2_5_VisionTransformerPretrainedModel computes in
Python: the rotary angles of each patch (image order), 2.5-VL's window_index (its merged rows in
window order; the graph reorders the rows and puts them back after the merger) and two additive
masks [1, N, N] over the rows, which images attend to each other and which window each row is in.

Both models are joined into one graph. One image a call, so the whole-image mask is zeros; the
window mask is made in the graph from each row's window (in window order), so an image's inputs
are O(N) and not two N x N arrays. Preprocessing and the prompt layout are the mmproj path's
(qwen_inputs.py, model.py), the projector named as the mmproj's of the same family."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.spec import read_json
from vinoserve.model.vision.mmproj import DynamicSize, VisionConfig
from vinoserve.model.vision.model import PreparedImage, VisionModel
from vinoserve.model.vision.qwen_inputs import rotary_angles, windows

VISION_XML = "openvino_vision_embeddings_model.xml"
MERGER_XML = "openvino_vision_embeddings_merger_model.xml"
# config.json model_type -> the mmproj projector whose preprocessing and layout it shares
QWEN_EXPORTS = {"qwen2_vl": "qwen2vl_merger", "qwen2_5_vl": "qwen2.5vl_merger"}
_STATES, _MASK, _WINDOW_MASK = "hidden_states", "attention_mask", "window_attention_mask"
_WINDOW_INDEX, _ROTARY, WINDOW_IDS = "window_index", "rotary_pos_emb", "window_ids"


class QwenExportVision(VisionModel):
    """Each image is its own call (the merger's inputs are one sequence of patches)."""

    def __init__(self, config: VisionConfig, path: Path, compiled: ov.CompiledModel) -> None:
        super().__init__(config, path, compiled, split=False)
        self._windowed = any(WINDOW_IDS in i.get_names() for i in compiled.inputs)

    def _encode_dynamic(self, images: Sequence[PreparedImage], pause: Callable[[], None] | None) -> list[np.ndarray]:
        """One graph a call: nowhere to pause inside an image."""
        out = []
        for image in images:
            merge = self.config.dynamic.merge
            inputs = merger_inputs((image.rope_grid[0] * merge, image.rope_grid[1] * merge), self.config,
                                   self._windowed)
            with self._lock:
                result = self._request.infer({**inputs, _STATES: image.pixels})
                out.append(np.array(next(iter(result.values())), np.float32))
        return out


def merger_inputs(grid: tuple[int, int], cfg: VisionConfig, windowed: bool) -> dict[str, np.ndarray]:
    """The joined graph's inputs beside the pixels for an image of `grid` patches, as optimum's
    OVModelForVisualCausalLM computes them (HF's rot_pos_emb, get_window_index)."""
    size = cfg.dynamic
    arrays = {_ROTARY: rotary_angles(grid, size.merge, cfg.hidden_size // cfg.num_heads)}
    if windowed:
        win = windows(grid, size.merge, size.window_size // size.merge // cfg.patch_size)
        per_window = win.valid.sum(axis=1)
        arrays[_WINDOW_INDEX] = win.order
        arrays[WINDOW_IDS] = np.repeat(np.arange(len(per_window), dtype=np.int64), per_window)
    return arrays


def qwen_export_config(path: Path, model_type: str) -> VisionConfig:
    config, processor = read_json(path / "config.json", required=True), _processor(path)
    vision = config.get("vision_config") or {}
    try:
        patch, merge = int(vision["patch_size"]), int(vision.get("spatial_merge_size", 2))
        size = processor.get("size") or {}
        full = [int(i) for i in vision.get("fullatt_block_indexes") or []]
        windowed = model_type == "qwen2_5_vl" and bool(full)
        dynamic = DynamicSize(
            merge=merge, min_pixels=int(processor.get("min_pixels") or size["shortest_edge"]),
            max_pixels=int(processor.get("max_pixels") or size["longest_edge"]),
            window_size=int(vision.get("window_size", 112)),
            wa_pattern=full[0] + 1 if windowed else 0)
        width = int(vision.get("embed_dim") or vision["hidden_size"])  # 2-VL's tower width is embed_dim
        cfg = VisionConfig(
            projector=QWEN_EXPORTS[model_type], image_size=patch * merge, patch_size=patch, hidden_size=width,
            num_heads=int(vision["num_heads"]), num_layers=int(vision["depth"]), layer_norm_eps=1e-6,
            activation=str(vision.get("hidden_act", "silu")),
            image_mean=tuple(float(v) for v in processor["image_mean"]),
            image_std=tuple(float(v) for v in processor["image_std"]),
            scale_factor=1, preproc_longest_edge=0, dynamic=dynamic)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: the Qwen-VL vision config cannot be read ({type(e).__name__}: {e})") from e
    if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3 or not 0 < dynamic.min_pixels <= dynamic.max_pixels:
        raise ModelLoadError(f"{path}: the processor's image_mean / image_std (3 values each) or its pixel range "
                             f"{dynamic.min_pixels}..{dynamic.max_pixels} are out of range")
    return cfg


def _processor(path: Path) -> dict:
    for name in ("preprocessor_config.json", "processor_config.json"):
        found = read_json(path / name)
        if found:
            return found.get("image_processor", found)
    raise ModelLoadError(f"{path}: no preprocessor_config.json (the image processor's settings)")


def read_qwen_vision(core: ov.Core, path: Path) -> ov.Model:
    """The two vision models as one: pixel rows (hidden_states), rotary_pos_emb and, for 2.5-VL,
    window_index and window_ids in; the image's rows (image order) out."""
    try:
        patches, merger = (core.read_model(path / name) for name in (VISION_XML, MERGER_XML))
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: a Qwen-VL vision model cannot be read (truncated or corrupt?): "
                             f"{last_line(e)}") from e
    names = {p.get_output_tensor(0).get_any_name(): p for p in merger.get_parameters()}
    if (len(patches.get_parameters()) != 1 or len(patches.outputs) != 1 or len(merger.outputs) != 1
            or set(names) - {_STATES, _MASK, _WINDOW_MASK, _WINDOW_INDEX, _ROTARY} or _STATES not in names):
        raise ModelLoadError(f"{path}: {VISION_XML} / {MERGER_XML} are not the Qwen-VL vision models optimum-intel "
                             f"exports (merger inputs: {sorted(names)})")
    pixels = patches.get_parameters()[0]
    pixels.output(0).set_names({_STATES})
    _replace(names.pop(_STATES), patches.get_results()[0].input_value(0))
    rows = ops.gather(ops.shape_of(pixels), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    square = ops.concat([ops.constant(np.array([1], np.int64)), rows, rows], 0)
    if _MASK in names:  # one image a call: every row sees every other
        _replace(names.pop(_MASK), ops.broadcast(ops.constant(np.float32(0)), square).output(0))
    params = list(names.values())
    if _WINDOW_MASK in names:
        ids = ops.parameter([-1], ov.Type.i64, name=WINDOW_IDS)
        ids.output(0).set_names({WINDOW_IDS})
        same = ops.equal(ops.unsqueeze(ids, ops.constant(np.int64(1))), ops.unsqueeze(ids, ops.constant(np.int64(0))))
        mask = ops.select(same, ops.constant(np.float32(0)), ops.constant(np.float32(-np.inf)))
        _replace(names[_WINDOW_MASK], ops.unsqueeze(mask, ops.constant(np.int64(0))).output(0))
        params = [p for p in params if p is not names[_WINDOW_MASK]] + [ids]
    model = ov.Model(merger.get_results(), [pixels, *params], "vision-qwen-export")
    model.validate_nodes_and_infer_types()
    return model


def _replace(param: ov.Node, source: ov.Output) -> None:
    for target in list(param.output(0).get_target_inputs()):
        target.replace_source_output(source)


def load_qwen_export(path: Path, model_type: str, text_hidden_size: int, precision: str | None, device: str,
                     num_threads: int | None) -> QwenExportVision:
    cfg = qwen_export_config(path, model_type)
    core = ov.Core()
    model = read_qwen_vision(core, path)
    width = model.output(0).get_partial_shape()[-1]
    if width.is_dynamic or width.get_length() != text_hidden_size:
        raise ModelLoadError(f"{path}/{MERGER_XML} writes rows of width {width}, but the language model's hidden "
                             f"size is {text_hidden_size}")
    options = EncoderOptions(device=device, inference_precision=precision, num_threads=num_threads)
    try:
        compiled = core.compile_model(model, device, options.properties())
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the Qwen-VL vision models do not compile: {last_line(e)}") from e
    return QwenExportVision(cfg, path, compiled)
