"""Images encoded beside decoding streams (issue 58: their time per output token within 1.5x).

The vision tower and the chat model share the cores: a tower run at full speed beside the
engine's decode steps slows every one of them for as long as it runs (a SmolVLM image is 13
SigLIP frames, seconds on a small machine). So, as the embedders do beside the chat model
(model/encoders/batcher.py), while the chat model has running requests the tower computes at most
`share` of the time: one frame at a time (a Qwen-VL image, of its own size, a stage of its tower
at a time), resting after each for as long as its compute took times (1 - share) / share. With nothing decoding it runs flat
out, its frames batched."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vinoserve.model.vision import PreparedImage, VisionModel


@dataclass(frozen=True)
class Pacing:
    chat_busy: Callable[[], bool] = lambda: False  # read between frames: the engine's running requests
    share: float = 1.0  # of the time the tower may compute while chat_busy(); 1: never rests

    def __post_init__(self) -> None:
        if not 0 < self.share:
            raise ValueError(f"the vision tower's share of the time must be above 0, not {self.share}")


def encode_paced(vision: VisionModel, images: Sequence[PreparedImage], pacing: Pacing) -> list[np.ndarray]:
    """`vision.encode(images)`, frame by frame with rests while the chat model decodes."""
    if pacing.share >= 1.0 or not images or not pacing.chat_busy():
        return vision.encode(images)
    rest, rows = _Rest(pacing), []
    for frame in _frames(vision, images):
        rest.mark()
        rows += vision.encode([frame], pause=rest)  # a staged tower rests between its stages too
        rest()
    flat = np.concatenate(rows)
    ends = np.cumsum([im.num_tokens for im in images])
    return [flat[end - im.num_tokens:end] for im, end in zip(images, ends)]


class _Rest:
    """Called after a piece of the tower's work: sleeps (1 - share) / share of the time since the
    last mark, while the chat model is busy."""

    def __init__(self, pacing: Pacing) -> None:
        self.pacing, self.since = pacing, time.perf_counter()

    def mark(self) -> None:
        self.since = time.perf_counter()

    def __call__(self) -> None:
        if self.pacing.chat_busy():
            time.sleep((time.perf_counter() - self.since) * (1 - self.pacing.share) / self.pacing.share)
        self.mark()


def _frames(vision: VisionModel, images: Sequence[PreparedImage]) -> list[PreparedImage]:
    """The images as the tower's smallest runs: a tiled image's frames, a Qwen-VL image whole (one
    sequence of its own size)."""
    cfg, frames = vision.config, []
    for im in images:
        if im.rope_grid is not None:
            frames.append(im)
        else:
            frames += [PreparedImage(f, cfg.num_tokens, im.key) for f in im.pixels.reshape(-1, 3, cfg.image_size,
                                                                                            cfg.image_size)]
    return frames
