"""Qwen2-VL / Qwen2.5-VL images in numpy and Pillow: the pixels as transformers'
Qwen2VLImageProcessor (PIL backend) makes them, and the per-size inputs its tower takes beside
them (the 2D rotary angles of each patch; 2.5-VL's windows, in whose order its tower takes them).

Pixels: RGB, resized (bicubic) to smart_resize's size (both sides multiples of patch x merge,
aspect kept, area within the file's min..max pixels), rescaled and normalised as the other
families, then cut into patches in HF's order: merge x merge blocks row by row, patches within
a block row by row, each patch's values (channel, temporal 2, row, column) with the image
repeated over the two temporal slots, as HF's patchify broadcasts a still image."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vinoserve.model.vision.mmproj import VisionConfig
from vinoserve.model.vision.preprocess import normalise

TEMPORAL = 2  # the patch convolution's frames (Conv3d kernel depth): a still image fills both
_ROPE_THETA = 10000.0  # the vision rotary's base in HF's config and clip.cpp alike
_MAX_ASPECT = 200  # smart_resize refuses images longer than this many times their width


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize, line for line (Python's round, as there)."""
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise ValueError(f"the image is {width}x{height}: its aspect ratio is above {_MAX_ASPECT}, which "
                         "Qwen-VL's image processor refuses")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_patches(rgb: Image.Image, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """float32 [patches, 3 * TEMPORAL * patch * patch] (HF's pixel_values rows) of an RGB image
    (see to_rgb), and its grid of patches (rows, columns)."""
    size = cfg.dynamic
    if size is None:
        raise ValueError(f"a {cfg.projector} projector takes no Qwen-VL patches")
    patch, merge = cfg.patch_size, size.merge
    height, width = smart_resize(rgb.height, rgb.width, patch * merge, size.min_pixels, size.max_pixels)
    pixels = normalise(np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC)), cfg)  # [3, H, W]
    gh, gw = height // patch, width // patch
    blocks = pixels.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row in block, col in block, C, y, x)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], TEMPORAL, patch, patch))
    return np.ascontiguousarray(frames.reshape(gh * gw, 3 * TEMPORAL * patch * patch)), (gh, gw)


def patch_positions(grid: tuple[int, int], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) in the image, in the rows' (merge-block) order."""
    gh, gw = grid
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")

    def blockwise(a: np.ndarray) -> np.ndarray:
        return a.reshape(gh // merge, merge, gw // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return blockwise(rows), blockwise(cols)


def rotary(grid: tuple[int, int], merge: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [patches, head_dim] f32 of HF's Qwen2_5_VLVisionRotaryEmbedding: head_dim / 4
    frequencies of the patch's row, then of its column, the pair repeated over the whole head
    (the rotation is rotate-half over all of it)."""
    angles = rotary_angles(grid, merge, head_dim)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotary_angles(grid: tuple[int, int], merge: int, head_dim: int) -> np.ndarray:
    """f32 [patches, head_dim / 2]: each patch's row angles, then its column angles (HF's rot_pos_emb)."""
    spatial = head_dim // 2  # per axis
    inv_freq = np.float32(1.0) / (np.float32(_ROPE_THETA) ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    rows, cols = patch_positions(grid, merge)
    return np.concatenate([rows[:, None].astype(np.float32) * inv_freq,
                           cols[:, None].astype(np.float32) * inv_freq], axis=-1)


@dataclass(frozen=True)
class Windows:
    """2.5-VL's windows over one image size, as HF's get_vision_window_index cuts them: squares
    of `cells` x `cells` merged rows from the top left, those at the right and bottom edges
    partial. The tower takes the patches window by window (HF's order) and pads each window to
    the full square for its windowed layers' attention."""
    order: np.ndarray  # int64 [merged rows]: the image's merged rows in window order (HF's window_index)
    gather: np.ndarray  # int64 [windows * slots]: the row (in window order) in each padded window slot; pads 0
    scatter: np.ndarray  # int64 [patches]: each row's slot in the padded windows
    valid: np.ndarray  # bool [windows, slots]: the slots that hold a row


def windows(grid: tuple[int, int], merge: int, cells: int) -> Windows:
    """The windows of an image of `grid` patches: `cells` merged rows a side."""
    high, wide = grid[0] // merge, grid[1] // merge
    across, down = -(-wide // cells), -(-high // cells)
    units = np.full((down * cells, across * cells), -1, np.int64)
    units[:high, :wide] = np.arange(high * wide).reshape(high, wide)
    slots = units.reshape(down, cells, across, cells).transpose(0, 2, 1, 3).reshape(-1)
    filled = np.repeat(slots >= 0, merge * merge)  # per patch slot
    gather = np.zeros(len(filled), np.int64)
    gather[filled] = np.arange(grid[0] * grid[1])
    return Windows(slots[slots >= 0], gather, np.flatnonzero(filled).astype(np.int64),
                   filled.reshape(down * across, -1))


@dataclass(frozen=True)
class SizeInputs:
    """What the tower takes for one image size beside its pixels."""
    arrays: dict[str, np.ndarray]  # the graph's other inputs (see qwen_tower.build_qwen_stages)
    rows: np.ndarray | None  # the prepared patch rows in the tower's order (2.5-VL: by window); None: as they are
    restore: np.ndarray | None  # the tower's output rows back in the image's order; None: as they are


def size_inputs(grid: tuple[int, int], cfg: VisionConfig) -> SizeInputs:
    """The rotary angles of an image of `grid` patches and, where the tower has windowed layers,
    its windows (the rows then go window by window, as in HF's tower, and come back after it)."""
    size = cfg.dynamic
    if size is None:
        raise ValueError(f"a {cfg.projector} projector takes no Qwen-VL patches")
    cos, sin = rotary(grid, size.merge, cfg.hidden_size // cfg.num_heads)
    if not size.windowed:
        return SizeInputs({"rope_cos": cos, "rope_sin": sin}, None, None)
    win = windows(grid, size.merge, size.window_size // size.merge // cfg.patch_size)
    per = size.merge * size.merge
    rows = (win.order[:, None] * per + np.arange(per)).reshape(-1)
    arrays = {"rope_cos": cos[rows], "rope_sin": sin[rows], "window_gather": win.gather,
              "window_scatter": win.scatter, "window_valid": win.valid}
    return SizeInputs(arrays, rows, np.argsort(win.order))
