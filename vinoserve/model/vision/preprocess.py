"""Pixels as each family's Hugging Face image processor makes them for one image, in numpy and
Pillow (the processors' PIL backend, step for step): RGB with transparency laid on white, resized
with the family's filter, rescaled by 1/255 and normalised per channel; [3, S, S] float32.

  mlp (LLaVA, CLIPImageProcessor): shortest edge to S (bicubic), centre crop S x S.
  gemma3 (Gemma3ImageProcessor): straight to S x S (bilinear); no pan-and-scan.
  idefics3 (Idefics3ImageProcessor, do_image_splitting=False): longest edge to the file's
      preprocessing size (even, aspect kept, lanczos), then to S x S (lanczos); no tiles.
"""
from __future__ import annotations

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


def _resized(image: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """uint8 [S, S, 3] of an RGB image."""
    size = cfg.image_size
    if cfg.projector == "mlp":
        return _centre_crop(np.asarray(_shortest_edge(image, size)), size)
    if cfg.projector == "gemma3":
        return np.asarray(image.resize((size, size), Image.Resampling.BILINEAR))
    first = _longest_edge(image, cfg.preproc_longest_edge)
    return np.asarray(first.resize((size, size), Image.Resampling.LANCZOS))


def normalise(pixels: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W]: HF's rescale (in float64, then float32) and its
    float32 normalisation, so the values match the processor's to the last bit."""
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    return np.ascontiguousarray((scaled - mean) / std, dtype=np.float32)


def preprocess(rgb: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """float32 [3, S, S] of an RGB image (see to_rgb)."""
    return normalise(_resized(rgb, cfg), cfg)
