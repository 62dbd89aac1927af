"""Images encoded beside decoding (issue 58's TPOT target): while the chat model has running
requests the vision tower computes one frame at a time and rests (1 - share) / share of each
frame's time; alone it batches the frames; the rows are the same either way."""
from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from vinoserve.bench import random_vlm
from vinoserve.model.vision import load_vision, qwen_tower
from vinoserve.server.vision_pacing import Pacing, encode_paced


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    """A tiny SmolVLM-shaped tower: a 64x48 image is 2x2 tiles and the whole, 5 frames."""
    vlm = random_vlm.tiny("smolvlm-500m")
    path = random_vlm.write_mmproj(vlm.tower, vlm.text.hidden, tmp_path_factory.mktemp("pace") / "mmproj.gguf")
    return load_vision(path, vlm.text.hidden)


class Counting:
    """A vision model's encode, counted and slowed to a known time a frame."""

    def __init__(self, vision, seconds_per_frame: float) -> None:
        self.vision, self.config, self.seconds = vision, vision.config, seconds_per_frame
        self.batches: list[int] = []

    def encode(self, images, pause=None):
        frames = sum(im.num_tokens for im in images) // self.config.num_tokens
        self.batches.append(frames)
        time.sleep(self.seconds * frames)
        return self.vision.encode(images)


def _images(vision, n: int):
    rng = np.random.default_rng(0)
    return [vision.prepare(Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))) for _ in range(n)]


def test_beside_decoding_frames_go_one_at_a_time_with_rests(smolvlm):
    images = _images(smolvlm, 2)
    frames = sum(im.num_tokens for im in images) // smolvlm.config.num_tokens
    assert frames == 10
    alone = smolvlm.encode(images)
    paced = Counting(smolvlm, 0.01)
    start = time.perf_counter()
    rows = encode_paced(paced, images, Pacing(lambda: True, share=0.25))
    # each frame's compute (>= 10 ms) followed by a rest of 3x as long
    assert time.perf_counter() - start >= frames * 0.01 * 4
    assert paced.batches == [1] * frames
    for a, b in zip(rows, alone):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_alone_or_at_share_1_the_frames_are_batched(smolvlm):
    images = _images(smolvlm, 2)
    for pacing in (Pacing(lambda: False, 0.25), Pacing(lambda: True, 1.0)):
        counting = Counting(smolvlm, 0.0)
        rows = encode_paced(counting, images, pacing)
        assert counting.batches == [10] and [r.shape[0] for r in rows] == [im.num_tokens for im in images]


def test_a_share_of_zero_is_refused():
    with pytest.raises(ValueError, match="above 0"):
        Pacing(lambda: True, 0.0)


def test_encoder_share_outside_zero_to_one_is_refused_at_the_command_line():
    from vinoserve.cli import build_parser

    assert build_parser().parse_args(["serve", "--encoder-share", "0.5"]).encoder_share == 0.5
    for bad in ("0", "-0.1", "1.5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--encoder-share", bad])


def test_qwen_images_are_paced_one_stage_of_one_image_at_a_time(tmp_path, monkeypatch):
    """A Qwen-VL image is one sequence of its own size: encoded alone, in turn, with a rest after
    each stage of its tower (here a stage a layer: 2); rows as unpaced."""
    monkeypatch.setattr(qwen_tower, "STAGE_LAYERS", 1)
    vlm = random_vlm.tiny("qwen2.5-vl-3b")
    vision = load_vision(random_vlm.write_mmproj(vlm.tower, vlm.text.hidden, tmp_path / "mmproj.gguf"),
                         vlm.text.hidden)
    rng = np.random.default_rng(1)
    images = [vision.prepare(Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)))
              for size in ((48, 64, 3), (90, 40, 3))]
    assert images[0].rope_grid != images[1].rope_grid
    seen, rests = [], []

    class Recording:
        config = vision.config

        def encode(self, batch, pause=None):
            seen.append([im.rope_grid for im in batch])
            return vision.encode(batch, pause=lambda: (rests.append(len(seen)), pause()))

    rows = encode_paced(Recording(), images, Pacing(lambda: True, share=0.5))
    assert seen == [[images[0].rope_grid], [images[1].rope_grid]] and rests == [1, 2]
    for a, b in zip(rows, vision.encode(images)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
