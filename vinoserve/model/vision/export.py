"""The vision side of an `optimum-cli export openvino --task image-text-to-text` directory as a
VisionModel: openvino_vision_embeddings_model.xml (pixels -> the projected rows the language model
takes) compiled as the mmproj graph would be, preprocessing from the processor's config and the
model's config.json, so prepare/encode/layout work as for an mmproj GGUF of the same family.

What each family's export holds (optimum-intel 2.1): LLaVA's tower to its feature layer, the CLS
row dropped and the projector; Gemma 3's tower, pooling and projector; Idefics3/SmolVLM's tower and
connector, with two more inputs (which patches are real and their positions) that a whole frame
fixes: they are computed inside the graph from pixel_values' shape, so the model takes pixels only.
Qwen2-VL / Qwen2.5-VL's two vision models: vision/qwen_export.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.spec import read_json
from vinoserve.model.vision.mmproj import VisionConfig
from vinoserve.model.vision.model import VisionModel, check_precision
from vinoserve.model.vision.qwen_export import (
    QWEN_EXPORTS,
    VISION_XML,
    load_qwen_export,
)

# config.json model_type -> the mmproj projector type whose preprocessing and layout it shares
PROJECTORS = {"llava": "mlp", "gemma3": "gemma3", "idefics3": "idefics3", "smolvlm": "idefics3", **QWEN_EXPORTS}
# HF's vision hidden_act -> the tower activation names VisionConfig uses
_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
_PATCH_MASK, _PATCH_POSITIONS = "patch_attention_mask", "patch_position_ids"


def is_vision_export(path: Path) -> bool:
    return path.is_dir() and (path / VISION_XML).is_file()


def load_export_vision(path: Path, text_hidden_size: int, *, precision: str | None = "f32", device: str = "CPU",
                       num_threads: int | None = None, split_images: bool | None = None) -> VisionModel:
    """As load_vision for an mmproj GGUF. `split_images`: None, as the export's processor says."""
    check_precision(precision)
    model_type = read_json(path / "config.json", required=True).get("model_type", "")
    if model_type in QWEN_EXPORTS:  # two vision models and per-size inputs: its own module
        return load_qwen_export(path, model_type, text_hidden_size, precision, device, num_threads)
    cfg, split = export_vision_config(path)
    compiled = compile_vision(path, cfg, text_hidden_size, precision, device, num_threads)
    return VisionModel(cfg, path, compiled, split if split_images is None else split_images)


def export_vision_config(path: Path) -> tuple[VisionConfig, bool]:
    """The export's VisionConfig (its projector type one of PROJECTORS' values) and whether its
    processor cuts large images into tiles (idefics3's do_image_splitting)."""
    config = read_json(path / "config.json", required=True)
    model_type = config.get("model_type", "")
    if model_type not in PROJECTORS:  # the language model's loader said so first (vlm_export.check_family)
        raise ModelLoadError(f"{path}: images from a {model_type or 'model_type-less'} export are not served "
                             f"(from IR: {', '.join(PROJECTORS)})")
    vision, processor = config.get("vision_config") or {}, _processor(path)
    projector = PROJECTORS[model_type]
    try:  # the tower's shape is the IR's; what is read of it here sizes the preprocessing and says what it is
        size, patch = int(vision["image_size"]), int(vision["patch_size"])
        cfg = VisionConfig(
            projector=projector, image_size=size, patch_size=patch, hidden_size=int(vision["hidden_size"]),
            num_heads=int(vision["num_attention_heads"]), num_layers=int(vision["num_hidden_layers"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            activation=_ACTIVATIONS.get(vision.get("hidden_act", ""), "gelu"),
            image_mean=tuple(float(v) for v in processor["image_mean"]),
            image_std=tuple(float(v) for v in processor["image_std"]),
            scale_factor=_scale_factor(config, projector, size // patch),
            preproc_longest_edge=int((processor.get("size") or {}).get("longest_edge", size)))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: the vision config cannot be read ({type(e).__name__}: {e})") from e
    _check_sizes(path, cfg, processor)
    return cfg, bool(processor.get("do_image_splitting", True))


def read_vision_graph(core: ov.Core, path: Path, cfg: VisionConfig) -> ov.Model:
    """The export's vision model taking pixel_values alone, checked to give cfg.num_tokens rows an image."""
    try:
        model = core.read_model(path / VISION_XML)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}/{VISION_XML} cannot be read (truncated or corrupt?): {last_line(e)}") from e
    names = {p.get_output_tensor(0).get_any_name(): p for p in model.get_parameters()}
    if "pixel_values" not in names or len(model.outputs) != 1:
        raise ModelLoadError(f"{path}/{VISION_XML}: not a vision embeddings model (pixel_values in, one output)")
    if set(names) - {"pixel_values", _PATCH_MASK, _PATCH_POSITIONS}:
        raise ModelLoadError(f"{path}/{VISION_XML} takes inputs vinoserve cannot give: {sorted(names)}")
    _whole_frame_patches(model, names, cfg.patches_per_side)
    rows = model.output(0).get_partial_shape()
    if rows.rank.get_length() != 3 or rows[1].is_dynamic or rows[1].get_length() != cfg.num_tokens:
        raise ModelLoadError(f"{path}/{VISION_XML} gives rows shaped {rows}; [images, {cfg.num_tokens}, width] "
                             f"expected of a {cfg.projector} model of this config")
    return model


def _whole_frame_patches(model: ov.Model, names: dict[str, ov.Node], side: int) -> None:
    """In place: idefics3's patch mask and positions from pixel_values' shape. Every frame is a
    whole S x S frame (preprocess.py), so every patch is real and patch i takes position i, as
    the mmproj tower adds them (HF's bucketize means the same for a full frame; its float32
    rounding moves a few positions by one where the side is no power of two)."""
    frames = ops.gather(ops.shape_of(names["pixel_values"]), ops.constant(np.array([0], np.int64)),
                        ops.constant(np.int64(0)))
    positions = np.arange(side * side)[None]
    made = {_PATCH_MASK: (np.ones((1, side, side), bool), [side, side]), _PATCH_POSITIONS: (positions, [side * side])}
    for name, (value, tail) in made.items():
        if name not in names:
            continue
        param = names[name]
        whole = ops.broadcast(ops.constant(value.astype(param.get_element_type().to_dtype())),
                              ops.concat([frames, ops.constant(np.array(tail, np.int64))], 0))
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(whole.output(0))
        model.remove_parameter(param)
    model.validate_nodes_and_infer_types()


def compile_vision(path: Path, cfg: VisionConfig, text_hidden_size: int, precision: str | None, device: str,
                   num_threads: int | None) -> ov.CompiledModel:
    core = ov.Core()
    model = read_vision_graph(core, path, cfg)
    width = model.output(0).get_partial_shape()[2]
    if width.is_dynamic or width.get_length() != text_hidden_size:
        raise ModelLoadError(f"{path}/{VISION_XML} writes rows of width {width}, but the language model's hidden "
                             f"size is {text_hidden_size}")
    options = EncoderOptions(device=device, inference_precision=precision, num_threads=num_threads)
    try:
        return core.compile_model(model, device, options.properties())
    except RuntimeError as e:
        raise ModelLoadError(f"{path}/{VISION_XML} does not compile: {last_line(e)}") from e


def _scale_factor(config: dict, projector: str, side: int) -> int:
    """Gemma 3: the pool kernel that leaves mm_tokens_per_image rows; Idefics3: its pixel shuffle."""
    if projector == "gemma3":
        return side // int(round(int(config.get("mm_tokens_per_image", 256)) ** 0.5))
    if projector == "idefics3":
        return int(config.get("scale_factor", 2))
    return 1


def _check_sizes(path: Path, cfg: VisionConfig, processor: dict) -> None:
    """The processor's sizes are the ones preprocess.py assumes of each family (its tower's input)."""
    size, crop = processor.get("size") or {}, processor.get("crop_size") or {}
    expected = {"mlp": [size.get("shortest_edge"), crop.get("height"), crop.get("width")],
                "gemma3": [size.get("height"), size.get("width")],
                "idefics3": [(processor.get("max_image_size") or {}).get("longest_edge", cfg.image_size)]}
    found = {int(v) for v in expected[cfg.projector] if v is not None}
    if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
        raise ModelLoadError(f"{path}: the processor's image_mean and image_std need 3 values each")
    if found - {cfg.image_size} or cfg.patches_per_side % cfg.scale_factor:
        raise ModelLoadError(f"{path}: the processor's image sizes {sorted(found)} are not the tower's "
                             f"{cfg.image_size} px (or {cfg.patches_per_side} patches a side do not divide by "
                             f"{cfg.scale_factor})")


def _processor(path: Path) -> dict:
    """The image processor's config: preprocessor_config.json, or processor_config.json's
    image_processor (transformers >= 5 writes the processor's parts into one file)."""
    if (path / "preprocessor_config.json").is_file():
        return read_json(path / "preprocessor_config.json")
    if (path / "processor_config.json").is_file():
        found = read_json(path / "processor_config.json").get("image_processor")
        if isinstance(found, dict):
            return found
    raise ModelLoadError(f"{path} has no preprocessor_config.json (the image processor's config, which "
                         "optimum-cli copies beside the export)")
