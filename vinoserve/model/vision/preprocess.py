"""Pixels as each family's Hugging Face image processor makes them for one image, in numpy and
Pillow (the processors' PIL backend, step for step): RGB with transparency laid on white, resized
with the family's filter, rescaled by 1/255 and normalised per channel; [3, S, S] float32.

  mlp (LLaVA, CLIPImageProcessor): shortest edge to S (bicubic), centre crop S x S.
  gemma3 (Gemma3ImageProcessor): straight to S x S (bilinear); no pan-and-scan.
  idefics3 (Idefics3ImageProcessor): longest edge to the file's preprocessing size (even,
      aspect kept, lanczos); then, splitting (HF's default; llama.cpp tiles these too), both
      sides up to multiples of S (lanczos), cut into S x S tiles row by row, plus the whole
      resized to S x S last; not splitting, straight to S x S.
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from vinoserve.model.vision.mmproj import VisionConfig

_MAX_IMAGE_SIZE = 4096  # Idefics3's processor: no side above this after its first resize


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _shortest_edge(image: Image.Image, size: int) -> Image.Image:
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    new_size = (size, new_long) if width <= height else (new_long, size)
    return image.resize(new_size, Image.Resampling.BICUBIC)


def _centre_crop(pixels: np.ndarray, size: int) -> np.ndarray:
    """[H, W, 3] -> [size, size, 3]; the shortest-edge resize leaves both sides >= size."""
    top, left = (pixels.shape[0] - size) // 2, (pixels.shape[1] - size) // 2
    return pixels[top:top + size, left:left + size]


def _longest_edge(image: Image.Image, max_len: int) -> Image.Image:
    """Idefics3's _resize_output_size_rescale_to_max_len then _scale_below_upper_bound."""
    width, height = image.size
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if width >= height and width > _MAX_IMAGE_SIZE:
        width, height = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE / (width / height))
    elif height > width and height > _MAX_IMAGE_SIZE:
        height, width = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE * (width / height))
    return image.resize((max(width, 1), max(height, 1)), Image.Resampling.LANCZOS)


def _to_multiples(image: Image.Image, size: int) -> Image.Image:
    """Idefics3's resize_for_vision_encoder: both sides up to multiples of `size`."""
    width, height = image.size
    aspect = width / height
    if width >= height:
        width = math.ceil(width / size) * size
        height = math.ceil(int(width / aspect) / size) * size
    else:
        height = math.ceil(height / size) * size
        width = math.ceil(int(height * aspect) / size) * size
    return image.resize((width, height), Image.Resampling.LANCZOS)


def _idefics3_frames(image: Image.Image, cfg: VisionConfig, split: bool) -> tuple[list[np.ndarray], tuple[int, int]]:
    size = cfg.image_size
    first = _longest_edge(image, cfg.preproc_longest_edge)
    whole = _to_multiples(first, size) if split else first.resize((size, size), Image.Resampling.LANCZOS)
    if whole.size == (size, size):
        return [np.asarray(whole)], (0, 0)
    rows, cols = whole.height // size, whole.width // size
    pixels = np.asarray(whole)
    frames = [pixels[r * size:(r + 1) * size, c * size:(c + 1) * size] for r in range(rows) for c in range(cols)]
    frames.append(np.asarray(whole.resize((size, size), Image.Resampling.LANCZOS)))
    return frames, (rows, cols)


def _frames(image: Image.Image, cfg: VisionConfig, split: bool) -> tuple[list[np.ndarray], tuple[int, int]]:
    """uint8 [S, S, 3] frames of an RGB image, and their grid of tiles ((0, 0): one frame)."""
    size = cfg.image_size
    if cfg.projector == "mlp":
        return [_centre_crop(np.asarray(_shortest_edge(image, size)), size)], (0, 0)
    if cfg.projector == "gemma3":
        return [np.asarray(image.resize((size, size), Image.Resampling.BILINEAR))], (0, 0)
    return _idefics3_frames(image, cfg, split)


def normalise(pixels: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W]: HF's rescale (in float64, then float32) and its
    float32 normalisation, so the values match the processor's to the last bit."""
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    return np.ascontiguousarray((scaled - mean) / std, dtype=np.float32)


def preprocess(rgb: Image.Image, cfg: VisionConfig, split: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
    """float32 [3, S, S] of an RGB image (see to_rgb), or [frames, 3, S, S] where it is cut into
    tiles (`split`: idefics3's do_image_splitting), and the tiles' (rows, cols)."""
    frames, grid = _frames(rgb, cfg, split)
    pixels = [normalise(frame, cfg) for frame in frames]
    return (pixels[0] if len(pixels) == 1 else np.stack(pixels)), grid
