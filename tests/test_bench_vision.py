"""`vinoserve bench vision` (issue 58's speed targets) and its random VLM files: tiny versions of
the LLaVA-1.5-7B, SmolVLM-500M and Qwen2.5-VL-3B shapes, written as the real-size ones are, load in vinoserve
and in llama.cpp (xllamacpp, where installed) and answer an image; the bench parses its
arguments, refuses bad ones, and runs end to end against vinoserve alone."""
from __future__ import annotations

import argparse

import gguf
import numpy as np
import pytest
from PIL import Image

from vinoserve.bench import random_vlm, vision
from vinoserve.cli import main
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.vision import load_vision

FAMILIES = ("llava-1.5-7b", "smolvlm-500m", "qwen2.5-vl-3b")


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf):
    """family -> (text GGUF, mmproj GGUF) of its tiny version."""
    where = tmp_path_factory.mktemp("vlm")
    return {f: random_vlm.write(random_vlm.tiny(f), where / f, f, "q8_0", log=lambda m: None) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_random_vlm_files_load_in_vinoserve(files, family):
    vlm = random_vlm.tiny(family)
    text, mmproj = files[family]
    src = GGUFModel.open(text)
    assert src.config.hidden_size == vlm.text.hidden and src.config.vocab_size == 49152 + len(vlm.tokens)
    tokens = src.reader.fields["tokenizer.ggml.tokens"].contents()
    types = src.reader.fields["tokenizer.ggml.token_type"].contents()
    assert tokens[-len(vlm.tokens):] == list(vlm.tokens)
    assert set(types[-len(vlm.tokens):]) == {int(gguf.TokenType.CONTROL)}
    model = load_vision(mmproj, vlm.text.hidden)
    assert model.projector == vlm.tower.projector and model.config.num_layers == vlm.tower.layers
    image = model.prepare(Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)))
    rows = model.encode([image])[0]
    assert rows.shape == (image.num_tokens, vlm.text.hidden) and np.isfinite(rows).all() and rows.std() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_random_vlm_files_load_in_llamacpp(files, family):
    """clip.cpp reads the mmproj (keys, tensor names, types its CPU ops take) and answers an image."""
    pytest.importorskip("xllamacpp")
    import httpx

    text, mmproj = files[family]
    server = vision.LlamaCppServer(str(text), str(mmproj), threads=1)
    try:
        with httpx.Client(timeout=120) as client:
            model = vision.served_model(client, server.url)
            body = vision.image_request(vision.png_data_url((64, 48), 0), 2, model)
            reply = client.post(f"{server.url}/v1/chat/completions", json=body).json()
    finally:
        server.close()
    assert reply["usage"]["completion_tokens"] == 2 and reply["usage"]["prompt_tokens"] > 10


def test_random_vlm_names():
    assert "smolvlm-500m-q8_0-random" in random_vlm.names() and "llava-1.5-7b-q4_k_m-random" in random_vlm.names()
    assert random_vlm.resolve("smollm2-135m-instruct") is None


def test_arguments_and_their_refusals(tmp_path):
    ap = argparse.ArgumentParser()
    vision.add_arguments(ap)
    args = ap.parse_args(["--image-size", "320x200", "--serve-arg=--kv-cache-size", "--serve-arg=0.05"])
    assert (args.model, args.mode, args.max_tokens, args.streams, args.llamacpp) == \
        ("smolvlm-500m-q8_0-random", "both", 1, 4, True)
    assert vision.image_size(args.image_size) == (320, 200) and args.serve_arg == ["--kv-cache-size", "0.05"]
    for bad in ("320", "0x10", "axb"):
        with pytest.raises(ValueError, match="--image-size"):
            vision.image_size(bad)
    lone = tmp_path / "m.gguf"
    lone.write_bytes(b"")
    with pytest.raises(ValueError, match="mmproj"):
        vision.model_files(str(lone), None)
    with pytest.raises(ValueError, match="random VLM"):
        vision.model_files("nope", None)


def test_bench_vision_end_to_end_against_vinoserve(files, capsys):
    text, mmproj = files["smolvlm-500m"]
    assert main(["bench", "vision", "--model", str(text), "--mmproj", str(mmproj), "--no-llamacpp", "--rounds", "2",
                 "--image-size", "64x48", "--streams", "2", "--stream-tokens", "8", "--threads", "1",
                 "--serve-arg=--kv-cache-size", "--serve-arg=0.05"]) == 0
    out = capsys.readouterr().out
    assert "CPU: " in out and "vinoserve: OpenVINO" in out and "llama.cpp" in out
    assert "round 2: vinoserve" in out and "TTFT ms (median)" in out
    assert "TPOT ms (median of 2 streams): alone" in out and "ratio" in out and "text prompts as long, sent at the same times" in out
