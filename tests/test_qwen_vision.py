"""Qwen2-VL and Qwen2.5-VL vision towers from mmproj GGUFs (model/vision) against transformers at
f32, on tiny random models written as llama.cpp's converter writes them: pixels equal to
Qwen2VLImageProcessorPil's (images keep their aspect), rows equal to get_image_features' within
1e-4 of their scale (2.5-VL's windows, partial ones at the edges included), images of several
sizes in one call each equal to alone; their place in the prompt; bad files refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from vision_fixtures import (
    CLIP_MEAN,
    CLIP_STD,
    TEXT_HIDDEN,
    as_stored,
    odd_images,
    tiny_qwen2vl,
    tiny_qwen25vl,
    write_mmproj,
)

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.vision import image_token, load_vision, qwen_tower
from vinoserve.model.vision.qwen_inputs import windows

UNIT = 28 * 28  # pixels per merged row: 14 px patches, 2 x 2 merged
PIXELS = (4 * UNIT, 100 * UNIT)  # small limits, written to the file and given to HF's processor alike
MODELS = {"qwen2vl_merger": tiny_qwen2vl, "qwen2.5vl_merger": tiny_qwen25vl}


def _images() -> list[Image.Image]:
    """The odd images, and a wide one resized to 14 x 22 patches (7 x 11 merged rows): 2 x 3 of
    2.5-VL's 4 x 4-row windows, those on the right and bottom partial."""
    wide = np.random.default_rng(8).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    return [*odd_images(), Image.fromarray(wide, "RGB")]


def _processor(pixels: tuple[int, int] = PIXELS) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(size={"shortest_edge": pixels[0], "longest_edge": pixels[1]},
                                    image_mean=CLIP_MEAN, image_std=CLIP_STD)


def _hf_rows(model, image: Image.Image) -> np.ndarray:
    """get_image_features' rows for one image, from HF's own processor: [rows, text width]."""
    inputs = _processor()(image, return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return out.pooler_output[0].numpy()


def _close(rows: np.ndarray, ref: np.ndarray) -> bool:
    return rows.shape == ref.shape and np.abs(rows - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.fixture(scope="module", params=list(MODELS))
def qwen(request, tmp_path_factory):
    """(projector, HF model, VisionModel) at f32."""
    hf = MODELS[request.param]()
    path = write_mmproj(hf, tmp_path_factory.mktemp("qwen") / "mmproj.gguf", pixels=PIXELS)
    return request.param, hf, load_vision(path, TEXT_HIDDEN)


def test_pixels_equal_the_hf_image_processor(qwen):
    *_, vision = qwen
    for image in _images():
        prepared = vision.prepare(image)
        hf = _processor()(image, return_tensors="np")
        t, h, w = hf["image_grid_thw"][0]
        assert (t, h, w) == (1, 2 * prepared.rope_grid[0], 2 * prepared.rope_grid[1]), f"{image.mode} {image.size}"
        assert prepared.num_tokens == prepared.rope_grid[0] * prepared.rope_grid[1]
        np.testing.assert_allclose(prepared.pixels, hf["pixel_values"], rtol=0, atol=1e-5,
                                   err_msg=f"{image.mode} {image.size}")
    assert vision.prepare(_images()[-1]).rope_grid == (7, 11)


def test_rows_equal_transformers_get_image_features(qwen):
    """All five images in one call, each against HF alone; the wide one's windows on 2.5-VL."""
    projector, hf, vision = qwen
    assert vision.projector == projector
    images = _images()
    for rows, image in zip(vision.encode([vision.prepare(im) for im in images]), images):
        ref = _hf_rows(hf, image)
        assert _close(rows, ref), f"{projector} {image.size}: {np.abs(rows - ref).max()} vs {np.abs(ref).max()}"


def test_a_tower_in_stages_of_one_layer_gives_the_same_rows_and_pauses_between_them(qwen, tmp_path, monkeypatch):
    """Each layer its own compiled stage (a server rests between stages): HF's rows still, and
    the pause called once between each two stages of every batch."""
    projector, hf, _ = qwen
    monkeypatch.setattr(qwen_tower, "STAGE_LAYERS", 1)
    vision = load_vision(write_mmproj(hf, tmp_path / "mmproj.gguf", pixels=PIXELS), TEXT_HIDDEN)
    layers = hf.config.vision_config.depth
    assert len(vision._stages) == layers > 1
    pauses = []
    images = _images()[:2]
    for rows, image in zip(vision.encode([vision.prepare(im) for im in images], pause=lambda: pauses.append(1)),
                           images):
        assert _close(rows, _hf_rows(hf, image)), f"{projector} {image.size}"
    assert len(pauses) == len(images) * (layers - 1)  # two sizes: one batch each


def test_several_images_in_one_call_each_equal_alone(qwen):
    """Same-size images (batched together) and other sizes in one call: each image's rows are
    those it gets alone."""
    *_, vision = qwen
    rgba, gray, _, tall, wide = _images()
    flipped = wide.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    prepared = [vision.prepare(im) for im in (wide, tall, flipped, gray, rgba)]
    together = vision.encode(prepared)
    for rows, image in zip(together, prepared):
        alone = vision.encode([image])[0]
        assert rows.shape == (image.num_tokens, TEXT_HIDDEN)
        np.testing.assert_allclose(rows, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    assert not np.allclose(together[0], together[2])


@pytest.mark.parametrize("grid", [(14, 22), (16, 16), (2, 30), (10, 2)])
def test_windows_are_hf_s(grid):
    """The window order and sizes are get_vision_window_index's (edge windows partial, sides a
    multiple of the window or not); the padded slots give back every row once."""
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor([[1, *grid]]), spatial_merge_size=2, window_size=112,
                                        patch_size=14)
    win = windows(grid, 2, 4)
    np.testing.assert_array_equal(win.order, index.numpy())
    np.testing.assert_array_equal(win.valid.sum(axis=1), np.diff(cu.numpy()))
    np.testing.assert_array_equal(win.gather[win.scatter], np.arange(grid[0] * grid[1]))


def test_window_size_from_the_file(tmp_path):
    """A file naming its window (56 px: 2 x 2 merged rows) gives HF's rows at that window."""
    hf = tiny_qwen25vl(seed=1, window_size=56)
    vision = load_vision(write_mmproj(hf, tmp_path / "mmproj.gguf", pixels=PIXELS), TEXT_HIDDEN)
    assert vision.config.dynamic.window_size == 56
    wide = _images()[-1]
    assert _close(vision.encode([vision.prepare(wide)])[0], _hf_rows(hf, wide))


def test_half_weights(tmp_path):
    """Matrices stored F16 (the converter's default) give HF's rows with its weights rounded so."""
    hf = tiny_qwen25vl()
    vision = load_vision(write_mmproj(hf, tmp_path / "mmproj.gguf", matrices="F16", pixels=PIXELS), TEXT_HIDDEN)
    wide = _images()[-1]
    rows = vision.encode([vision.prepare(wide)])[0]
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.from_numpy(as_stored(p.numpy(), "F16")))
    assert _close(rows, _hf_rows(hf, wide))


def test_default_limits_are_llama_cpp_s(tmp_path):
    """Without image_min/max_pixels in the file, images resize within 8 to 4096 merged rows."""
    vision = load_vision(write_mmproj(tiny_qwen2vl(), tmp_path / "mmproj.gguf"), TEXT_HIDDEN)
    limits = (8 * UNIT, 4096 * UNIT)
    for size in ((20, 20), (3000, 2000)):
        image = Image.new("RGB", size, (200, 30, 90))
        prepared = vision.prepare(image)
        hf = _processor(limits)(image, return_tensors="np")
        assert tuple(hf["image_grid_thw"][0][1:] // 2) == prepared.rope_grid
        assert 8 <= prepared.num_tokens <= 4096
    assert vision.prepare(Image.new("RGB", (20, 20))).rope_grid == (3, 3)


def test_layout_and_image_token(qwen):
    """<|vision_start|>, the image's rows, <|vision_end|>: the text Qwen-VL's chat template and
    processor write for an image, with its rows where the <|image_pad|> tokens stand."""
    projector, _, vision = qwen
    for image in _images():
        prepared = vision.prepare(image)
        assert vision.layout(prepared) == ["<|vision_start|>", prepared.num_tokens, "<|vision_end|>"]
    assert image_token(projector) == "<|image_pad|>"
    assert [image_token(p) for p in ("mlp", "gemma3", "idefics3")] == ["<image>", "<image_soft_token>", "<image>"]


def test_bad_files_and_images_are_refused(tmp_path, qwen):
    *_, vision = qwen
    with pytest.raises(ModelLoadError, match="Qwen2.5-VL projector without clip.vision.n_wa_pattern"):
        load_vision(write_mmproj(tiny_qwen2vl(), tmp_path / "no-pattern.gguf", projector="qwen2.5vl_merger"),
                    TEXT_HIDDEN)
    with pytest.raises(ModelLoadError, match="width 48.*hidden size is 64"):
        load_vision(write_mmproj(tiny_qwen2vl(), tmp_path / "qwen.gguf"), 64)
    with pytest.raises(ValueError, match="aspect ratio is above 200"):
        vision.prepare(Image.new("RGB", (2010, 10)))
