"""Vision towers from mmproj GGUFs (model/vision) against transformers at f32, on tiny random
LLaVA 1.5, Gemma 3 and Idefics3 models written by the tests' own llama.cpp-style writer:
pixels equal to the HF image processors' (PIL backend) within 1e-5, embedding rows equal to
get_image_features' within 1e-4 of their scale, batches equal to single images; bad images and
wrong files refused with one clear line."""
from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, Gemma3ImageProcessorPil, Idefics3ImageProcessorPil
from vision_fixtures import (CLIP_MEAN, CLIP_STD, HALF, TEXT_HIDDEN, as_stored, odd_images, tiny_gemma3,
                             tiny_idefics3, tiny_llava, write_mmproj)

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.vision import decode_image, load_vision

FAMILIES = {"mlp": tiny_llava, "gemma3": tiny_gemma3, "idefics3": tiny_idefics3}


def _hf_processor(variant: str):
    if variant == "mlp":
        return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                     image_mean=CLIP_MEAN, image_std=CLIP_STD)
    if variant == "gemma3":
        return Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=HALF, image_std=HALF)
    return Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                     do_image_splitting=variant == "idefics3", image_mean=HALF, image_std=HALF,
                                     return_row_col_info=True)


def _hf_rows(model, projector: str, pixels: np.ndarray) -> np.ndarray:
    """get_image_features' rows for one prepared image's pixels ([3, S, S] or [frames, 3, S, S]):
    [tokens, text width]."""
    pv = torch.from_numpy(pixels.reshape(-1, *pixels.shape[-3:]))
    with torch.no_grad():
        if projector == "mlp":
            out = model.get_image_features(pv, vision_feature_layer=-2, vision_feature_select_strategy="default")
        elif projector == "gemma3":
            out = model.get_image_features(pv)
        else:
            out = model.get_image_features(pv[None])  # [1 sample, frames, 3, S, S]
    return np.concatenate([np.asarray(r).reshape(-1, TEXT_HIDDEN) for r in out.pooler_output])


@pytest.fixture(scope="module", params=["mlp", "gemma3", "idefics3", "idefics3-whole"])
def family(request, tmp_path_factory):
    """(variant, projector, HF model, VisionModel); idefics3 tiles large images (HF's default
    do_image_splitting), idefics3-whole does not."""
    projector = request.param.split("-")[0]
    hf = FAMILIES[projector]()
    path = write_mmproj(hf, tmp_path_factory.mktemp(projector) / "mmproj.gguf")
    return request.param, projector, hf, load_vision(path, TEXT_HIDDEN, split_images=request.param == "idefics3")


def test_pixels_equal_the_hf_image_processor(family):
    variant, _, _, vision = family
    processor = _hf_processor(variant)
    for image in odd_images():
        prepared = vision.prepare(image)
        ours = prepared.pixels.reshape(-1, 3, 32, 32)
        hf = processor(image, return_tensors="np")
        theirs = np.asarray(hf["pixel_values"], np.float32).reshape(-1, 3, 32, 32)
        assert ours.shape == theirs.shape, f"{variant} {image.size}"
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5, err_msg=f"{variant} {image.mode} {image.size}")
        if variant.startswith("idefics3"):
            assert prepared.grid == (hf["rows"][0][0], hf["cols"][0][0])


def test_rows_equal_transformers_get_image_features(family):
    variant, projector, hf, vision = family
    prepared = [vision.prepare(image) for image in odd_images()]
    assert vision.projector == projector
    if variant == "idefics3":
        assert [p.grid for p in prepared] == [(2, 2), (2, 2), (2, 2), (2, 1)]  # tiles and the whole image
    for rows, image in zip(vision.encode(prepared), prepared):
        ref = _hf_rows(hf, projector, image.pixels)
        assert rows.shape == (image.num_tokens, TEXT_HIDDEN) == ref.shape
        assert np.abs(rows - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_batch_gives_each_image_its_own_rows(family):
    *_, vision = family
    images = [vision.prepare(image) for image in odd_images()]
    together = vision.encode(images)
    for t, image in zip(together, images):
        alone = vision.encode([image])[0]
        np.testing.assert_allclose(t, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    assert not np.allclose(together[0], together[1])


def test_layout_places_the_rows_in_the_family_s_text(family):
    """The layout, its runs written out as image tokens, is the text HF's processor writes for
    the image (Idefics3Processor.replace_image_token's, tiles and all)."""
    from transformers import Idefics3Processor

    _, projector, _, vision = family
    for image in odd_images():
        prepared = vision.prepare(image)
        layout = vision.layout(prepared)
        assert sum(part for part in layout if isinstance(part, int)) == prepared.num_tokens
        text = "".join(part if isinstance(part, str) else "<image>" * part for part in layout)
        if projector == "idefics3":
            names = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_tag="<global-img>",
                                    image_token="<image>", image_seq_len=4)
            rows_cols = {"rows": [[prepared.grid[0]]], "cols": [[prepared.grid[1]]]}
            assert text == Idefics3Processor.replace_image_token(names, rows_cols, 0)
        elif projector == "gemma3":
            assert layout == ["\n\n<start_of_image>", 4, "<end_of_image>\n\n"]
        else:
            assert layout == [16]


def test_the_cache_key_follows_the_pixels(family):
    *_, vision = family
    rgba, gray, *_ = odd_images()
    key = vision.prepare(rgba).key
    assert isinstance(key, bytes) and len(key) == 16
    assert vision.prepare(rgba.copy()).key == key
    changed = rgba.copy()
    changed.putpixel((3, 4), (1, 2, 3, 255))
    assert vision.prepare(changed).key != key
    assert vision.prepare(gray).key != vision.prepare(gray.resize((80, 81))).key


def test_a_legacy_llava_file_without_feature_layer(tmp_path):
    """A legacy LLaVA file naming no feature layer (converted from a CLIP-only directory) runs
    every block it stores, which the converter cut at HF's vision_feature_layer -2. llama.cpp
    runs one fewer there (ggml-org/llama.cpp#25817), which this must not."""
    hf = tiny_llava(layers=4)
    legacy = load_vision(write_mmproj(hf, tmp_path / "legacy.gguf", feature_layer=False), TEXT_HIDDEN)
    prepared = legacy.prepare(odd_images()[1])
    ref = _hf_rows(hf, "mlp", prepared.pixels)
    assert np.abs(legacy.encode([prepared])[0] - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("matrices", ["F16", "Q8_0"])
def test_half_and_quantized_weights(tmp_path, matrices):
    """Matrices stored F16 (the converters' default) or Q8_0 give the rows of the weights as
    stored: HF with its weights rounded the same way; the unrounded model differs."""
    hf = tiny_gemma3()
    vision = load_vision(write_mmproj(hf, tmp_path / "mmproj.gguf", matrices=matrices), TEXT_HIDDEN)
    prepared = vision.prepare(odd_images()[0])
    rows = vision.encode([prepared])[0]
    exact = _hf_rows(hf, "gemma3", prepared.pixels)
    assert np.abs(rows - exact).max() > 1e-4 * np.abs(exact).max()  # the rounding shows
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.from_numpy(as_stored(p.numpy(), matrices)))
    ref = _hf_rows(hf, "gemma3", prepared.pixels)
    assert np.abs(rows - ref).max() <= 1e-4 * np.abs(ref).max()


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_decode_image_refuses_bad_data():
    image = odd_images()[0]
    decoded = decode_image(_png(image), max_pixels=10_000)
    assert decoded.size == image.size and decoded.mode == "RGBA"
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"this is plain text, not a picture", max_pixels=10_000)
    with pytest.raises(ValueError, match="cannot be decoded|cannot be read"):
        decode_image(_png(image)[:200], max_pixels=10_000)
    with pytest.raises(ValueError, match="pixels"):
        decode_image(_png(image), max_pixels=1000)
    tiff = io.BytesIO()
    image.save(tiff, "TIFF")
    with pytest.raises(ValueError, match="format TIFF is not supported"):
        decode_image(tiff.getvalue(), max_pixels=10_000)


def test_decode_image_checks_the_declared_size_before_decoding():
    """A PNG header declaring 100000 x 100000 pixels over a few bytes of data: refused from the
    header, without allocating the canvas."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    with pytest.raises(ValueError, match="pixels"):
        decode_image(bomb, max_pixels=50_000_000)


def test_wrong_files_are_refused(tmp_path):
    from gguf_fixtures import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    chat = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ModelLoadError, match="not a vision projector.*'llama'"):
        load_vision(write_gguf(chat, tmp_path / "chat.gguf"), 32)
    hf = tiny_gemma3()
    with pytest.raises(ModelLoadError, match="'qwen3vl_merger' is not supported"):
        load_vision(write_mmproj(hf, tmp_path / "qwen.gguf", projector="qwen3vl_merger"), TEXT_HIDDEN)
    with pytest.raises(ModelLoadError, match="width 48.*hidden size is 64"):
        load_vision(write_mmproj(hf, tmp_path / "gemma.gguf"), 64)
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_vision(tmp_path / "text.gguf", TEXT_HIDDEN)

