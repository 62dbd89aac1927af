"""A vision model ready to run: an mmproj GGUF read, its tower + projector compiled as one
OpenVINO model (own infer request, beside the language model's), each family's preprocessing
and its place in the prompt."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
from PIL import Image

from vinoserve.model.compile_options import PRECISIONS
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.vision.mmproj import MMProj, VisionConfig, read_mmproj
from vinoserve.model.vision.preprocess import preprocess, to_rgb
from vinoserve.model.vision.projectors import build_vision_model, projection_width

# Images per inference: bounds the activations (a 400M SigLIP at 896 px holds ~100 MB per image
# in flight) while still batching the usual few images of a request.
MAX_BATCH = 8
# The text each family's HF processor puts around an image's rows (Gemma3Processor's
# full_image_sequence, Idefics3Processor's single-image form); LLaVA puts none.
_AROUND = {"mlp": ("", ""), "gemma3": ("\n\n<start_of_image>", "<end_of_image>\n\n"),
           "idefics3": ("<fake_token_around_image><global-img>", "<fake_token_around_image>")}


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # float32 [3, H, W], as the family's processor gives them
    num_tokens: int  # embedding rows it becomes
    key: bytes  # blake2b-16 of the decoded RGB pixels + size: the prefix-cache key


def image_key(rgb: Image.Image) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.digest()


class VisionModel:
    """`encode` is thread-safe (one infer request, locked), `prepare` needs no lock."""

    def __init__(self, mm: MMProj, compiled: ov.CompiledModel) -> None:
        self.config: VisionConfig = mm.config
        self.projector: str = mm.config.projector
        self.path = mm.path
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()

    def prepare(self, image: Image.Image) -> PreparedImage:
        rgb = to_rgb(image)
        return PreparedImage(preprocess(rgb, self.config), self.config.num_tokens, image_key(rgb))

    def encode(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        """Each image's rows, [num_tokens, text width] float32, in order."""
        out: list[np.ndarray] = []
        for start in range(0, len(images), MAX_BATCH):
            batch = np.stack([im.pixels for im in images[start:start + MAX_BATCH]])
            with self._lock:
                result = self._request.infer({"pixel_values": batch})
                rows = np.array(next(iter(result.values())), np.float32)
            out.extend(rows)
        return out

    def layout(self, image: PreparedImage) -> list[str | int]:
        """The image in the prompt, in order: text to tokenize and runs of embedding rows."""
        before, after = _AROUND[self.projector]
        return [part for part in (before, image.num_tokens, after) if part != ""]


def load_vision(mmproj: Path, text_hidden_size: int, *, precision: str | None = "f32", device: str = "CPU",
                num_threads: int | None = None) -> VisionModel:
    """`precision`: the compiled model's inference precision (None: the device's default)."""
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"vision precision {precision!r}; one of {', '.join(PRECISIONS)}")
    mm = read_mmproj(Path(mmproj))
    width = projection_width(mm)
    if width != text_hidden_size:
        raise ModelLoadError(f"{mmproj}: the projector writes rows of width {width}, but the language model's "
                             f"hidden size is {text_hidden_size}: this mmproj belongs to another model")
    options = EncoderOptions(device=device, inference_precision=precision, num_threads=num_threads)
    try:  # a tensor of the wrong shape fails while the graph is built, a device limit while compiling
        compiled = ov.Core().compile_model(build_vision_model(mm), device, options.properties())
    except RuntimeError as e:
        raise ModelLoadError(f"{mmproj}: the vision graph does not build: {last_line(e)}") from e
    return VisionModel(mm, compiled)
