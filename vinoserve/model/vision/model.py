"""A vision model ready to run: an mmproj GGUF read, its tower + projector compiled as one
OpenVINO model (own infer request, beside the language model's), each family's preprocessing
and its place in the prompt."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
from PIL import Image

from vinoserve.model.compile_options import PRECISIONS
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.vision.layout import image_layout
from vinoserve.model.vision.mmproj import VisionConfig, read_mmproj
from vinoserve.model.vision.preprocess import preprocess, to_rgb
from vinoserve.model.vision.projectors import build_vision_model, projection_width
from vinoserve.model.vision.qwen_inputs import qwen_patches, size_inputs

# Frames per inference: bounds the activations (a 400M SigLIP at 896 px holds ~100 MB per frame
# in flight) while still batching the usual few images (or one image's tiles) of a request.
MAX_BATCH = 8
# Qwen-VL: same-size images batch up to about this many patches (8 frames of a 384 px SigLIP hold
# ~4.6k); a larger image runs alone
MAX_BATCH_PATCHES = 4096


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # float32 [3, H, W] (or [frames, 3, H, W]), as the family's processor gives them
    num_tokens: int  # embedding rows it becomes
    key: bytes  # blake2b-16 of the decoded RGB pixels + size: the prefix-cache key
    grid: tuple[int, int] = (0, 0)  # idefics3's tiles (rows, cols) before the whole image; (0, 0): none
    # Qwen-VL: the image's merged rows (rows, cols), num_tokens of them in row-major order, the
    # grid its language model's M-RoPE positions span; None for the fixed-size families
    rope_grid: tuple[int, int] | None = None


def image_key(rgb: Image.Image) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.digest()


class VisionModel:
    """`encode` is thread-safe (one infer request a stage, locked), `prepare` needs no lock."""

    def __init__(self, config: VisionConfig, path: Path, compiled: ov.CompiledModel | Sequence[ov.CompiledModel],
                 split: bool = True) -> None:
        """`path`: where it was read from (an mmproj GGUF, or an export's directory: vision/export.py).
        `compiled`: the model, or its stages run one after another (a Qwen-VL tower's)."""
        self.config: VisionConfig = config
        self.projector: str = config.projector
        self.split = split
        self.path = path
        stages = [compiled] if isinstance(compiled, ov.CompiledModel) else list(compiled)
        self._stages = [(c.create_infer_request(), {n for i in c.inputs for n in i.get_names()}) for c in stages]
        self._request = self._stages[0][0]
        self._lock = threading.Lock()

    def prepare(self, image: Image.Image) -> PreparedImage:
        rgb = to_rgb(image)
        if self.config.dynamic:  # pixels: [patches, 3*2*P*P] as Qwen2VLImageProcessor's pixel_values
            pixels, (rows, cols) = qwen_patches(rgb, self.config)
            merge = self.config.dynamic.merge
            rope_grid = (rows // merge, cols // merge)
            return PreparedImage(pixels, rope_grid[0] * rope_grid[1], image_key(rgb), rope_grid=rope_grid)
        pixels, grid = preprocess(rgb, self.config, self.split)
        frames = 1 if pixels.ndim == 3 else len(pixels)
        return PreparedImage(pixels, frames * self.config.num_tokens, image_key(rgb), grid)

    def encode(self, images: Sequence[PreparedImage], pause: Callable[[], None] | None = None) -> list[np.ndarray]:
        """Each image's rows, [num_tokens, text width] float32, in order (a tiled image's
        frames one after another, as the layout places them). `pause`: called between a staged
        tower's stages (a busy server rests there)."""
        if not images:
            return []
        if self.config.dynamic:
            return self._encode_dynamic(images, pause)
        size = self.config.image_size
        frames = np.concatenate([im.pixels.reshape(-1, 3, size, size) for im in images])
        rows = []
        for start in range(0, len(frames), MAX_BATCH):
            with self._lock:
                result = self._request.infer({"pixel_values": frames[start:start + MAX_BATCH]})
                rows.append(np.array(next(iter(result.values())), np.float32))
        flat = np.concatenate(rows).reshape(-1, rows[0].shape[-1])
        ends = np.cumsum([im.num_tokens for im in images])
        return [flat[end - im.num_tokens:end] for im, end in zip(images, ends)]

    def _encode_dynamic(self, images: Sequence[PreparedImage], pause: Callable[[], None] | None) -> list[np.ndarray]:
        """Qwen-VL: each image its own sequence; images of one size share their rotary angles
        and windows, and batch. 2.5-VL's rows go through the tower window by window (HF's
        order) and come back in the image's."""
        size = self.config.dynamic
        out: list[np.ndarray] = [np.empty(0)] * len(images)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            by_grid.setdefault(image.rope_grid, []).append(i)
        for (rows, cols), indices in by_grid.items():
            grid = (rows * size.merge, cols * size.merge)
            extra = size_inputs(grid, self.config)
            step = max(1, min(MAX_BATCH, MAX_BATCH_PATCHES // (grid[0] * grid[1])))
            for start in range(0, len(indices), step):
                batch = indices[start:start + step]
                pixels = np.stack([images[i].pixels for i in batch])
                pixels = pixels if extra.rows is None else pixels[:, extra.rows]
                embeddings = self._staged({**extra.arrays, "pixel_values": pixels}, pause)
                for i, image_rows in zip(batch, embeddings):
                    out[i] = image_rows if extra.restore is None else image_rows[extra.restore]
        return out

    def _staged(self, inputs: dict[str, np.ndarray], pause: Callable[[], None] | None) -> np.ndarray:
        """The stages in turn, each given the inputs it takes and the states before it."""
        for n, (request, names) in enumerate(self._stages):
            if n and pause is not None:
                pause()
            with self._lock:
                result = request.infer({k: v for k, v in inputs.items() if k in names})
                inputs["states"] = np.array(next(iter(result.values())), np.float32)
        return inputs.pop("states")

    def layout(self, image: PreparedImage) -> list[str | int]:
        """The image in the prompt, in order: text to tokenize and runs of embedding rows."""
        rows = image.num_tokens if image.rope_grid else self.config.num_tokens
        return image_layout(self.projector, rows, image.grid)


def check_precision(precision: str | None) -> None:
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"vision precision {precision!r}; one of {', '.join(PRECISIONS)}")


def load_vision(mmproj: Path, text_hidden_size: int, *, precision: str | None = "f32", device: str = "CPU",
                num_threads: int | None = None, split_images: bool = True) -> VisionModel:
    """`precision`: the compiled model's inference precision (None: the device's default).
    `split_images`: idefics3 cuts large images into tiles as its processor does by default
    (more rows, more detail); False gives one frame per image."""
    check_precision(precision)
    mm = read_mmproj(Path(mmproj))
    width = projection_width(mm)
    if width != text_hidden_size:
        raise ModelLoadError(f"{mmproj}: the projector writes rows of width {width}, but the language model's "
                             f"hidden size is {text_hidden_size}: this mmproj belongs to another model")
    options = EncoderOptions(device=device, inference_precision=precision, num_threads=num_threads)
    try:  # a tensor of the wrong shape fails while the graph is built, a device limit while compiling
        core = ov.Core()
        compiled = [core.compile_model(stage, device, options.properties()) for stage in build_vision_model(mm)]
    except RuntimeError as e:
        raise ModelLoadError(f"{mmproj}: the vision graph does not build: {last_line(e)}") from e
    return VisionModel(mm.config, mm.path, compiled, split_images)
