"""Tiny random vision-language models (LLaVA 1.5, Gemma 3, Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL)
saved as HF directories with their tokenizer and image processor, and exported to OpenVINO IR as
users export theirs: optimum-intel's `main_export(..., task="image-text-to-text")`, what `optimum-cli export openvino
--task image-text-to-text` runs."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from PIL import Image
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration,
                          Gemma3ImageProcessorPil, Gemma3TextConfig, Idefics3Config, Idefics3ForConditionalGeneration,
                          Idefics3VisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                          Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, SiglipVisionConfig, SmolVLMConfig,
                          SmolVLMForConditionalGeneration, SmolVLMVisionConfig)

from ir_fixtures import hf_tokenizer
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.scheduler import SchedulerConfig
from vinoserve.server.images import ImageRef, image_prompt
from vinoserve.server.media import MediaPolicy
from vision_fixtures import CLIP_MEAN, CLIP_STD, HALF

# Each family's special tokens, added after the fixtures' byte-level vocabulary (ids 260...)
SPECIALS = {
    "llava": ["<image>"],
    "gemma3": ["<image_soft_token>", "<start_of_image>", "<end_of_image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>",
                 *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]],
}
SPECIALS["smolvlm"] = SPECIALS["idefics3"]
FAMILIES = tuple(SPECIALS)
# Qwen-VL: images at their own size, placed by M-RoPE (tests/test_ir_qwen_vision.py)
QWEN_FAMILIES = ("qwen2_5_vl", "qwen2_vl")
SPECIALS |= {family: ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
             for family in QWEN_FAMILIES}
# the language model's M-RoPE sections (t, h, w) fill its head_dim / 2 = 12 rotary pairs, unevenly as the real ones
_MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 5, 5], "rope_theta": 1e6}}
_TEXT = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 512}
_TOWER = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 2}


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def tokenizer(family: str):
    tok = hf_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[family]})
    tok.chat_template = CHAT_TEMPLATE  # the export's tokenizer carries it, as a real model's does
    return tok


def _model(family: str, ids: dict[str, int]):
    vocab = 260 + len(SPECIALS[family])
    if family == "llava":
        vision = CLIPVisionConfig(image_size=32, patch_size=8, num_hidden_layers=3, projection_dim=16, **_TOWER)
        return LlavaForConditionalGeneration(LlavaConfig(
            vision_config=vision, text_config=LlamaConfig(vocab_size=vocab, **_TEXT), image_token_index=ids["<image>"]))
    if family == "gemma3":
        vision = SiglipVisionConfig(image_size=32, patch_size=4, num_hidden_layers=2, **_TOWER)
        # windows of 16 on the first layer: shorter than the prompts, longer than an image's 16 rows
        text = Gemma3TextConfig(vocab_size=vocab, head_dim=24, sliding_window=16, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention"], **_TEXT)
        return Gemma3ForConditionalGeneration(Gemma3Config(
            vision_config=vision, text_config=text, mm_tokens_per_image=16, image_token_index=ids["<image_soft_token>"],
            boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"]))
    if family in QWEN_FAMILIES:
        return _qwen(family, ids, {"vocab_size": vocab, **_TEXT, **_MROPE})
    vision = {"image_size": 32, "patch_size": 8, "num_hidden_layers": 2, **_TOWER}
    if family == "smolvlm":
        return SmolVLMForConditionalGeneration(SmolVLMConfig(
            vision_config=SmolVLMVisionConfig(**vision), text_config=LlamaConfig(vocab_size=vocab, **_TEXT),
            scale_factor=2, image_token_id=ids["<image>"]))
    return Idefics3ForConditionalGeneration(Idefics3Config(
        vision_config=Idefics3VisionConfig(**vision), text_config=LlamaConfig(vocab_size=vocab, **_TEXT),
        scale_factor=2, image_token_id=ids["<image>"]))


def _qwen(family: str, ids: dict[str, int], text: dict):
    """2.5-VL: windows of 56 px (2 x 2 merged rows) on layers 0 and 2, so an image spans several."""
    tokens = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": _TEXT["hidden_size"], "mlp_ratio": 2, "num_heads": 2}
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=text, **tokens))
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2,
              "out_hidden_size": _TEXT["hidden_size"], "fullatt_block_indexes": [1, 3], "window_size": 56}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, text_config=text, **tokens))


def image_processor(family: str):
    """The family's HF image processor at the tiny towers' 32 px (LLaVA's and Gemma 3's); Qwen-VL's
    at 8 to 64 merged rows an image."""
    if family in QWEN_FAMILIES:
        return Qwen2VLImageProcessorPil(min_pixels=8 * 28 * 28, max_pixels=64 * 28 * 28)
    if family == "llava":
        return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                     image_mean=CLIP_MEAN, image_std=CLIP_STD)
    return Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=HALF, image_std=HALF)


# Idefics3ImageProcessorPil of transformers 5.5 (the IR venv's) asks for torchvision: its config as
# that processor saves it (tests/test_vision_towers.py checks vinoserve's pixels against it)
IDEFICS3_PROCESSOR = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
                      "size": {"longest_edge": 64}, "resample": 1, "do_image_splitting": True,
                      "max_image_size": {"longest_edge": 32}, "do_rescale": True, "rescale_factor": 1 / 255,
                      "do_normalize": True, "image_mean": HALF, "image_std": HALF, "do_pad": True}


def save_tiny_vlm(family: str, out: Path, seed: int = 0):
    """The random model (eval, f32), saved with its tokenizer and image processor into `out`."""
    tok = tokenizer(family)
    model = _model(family, {t: tok.convert_tokens_to_ids(t) for t in SPECIALS[family]}).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight random (HF zero-initialises Gemma 3's projection), norms near 1
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)
    model.generation_config.eos_token_id = None  # EOS just another token, as with ignore_eos
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if family in ("idefics3", "smolvlm"):
        (out / "preprocessor_config.json").write_text(json.dumps(IDEFICS3_PROCESSOR))
    else:
        image_processor(family).save_pretrained(out)
    return model


def export_vlm(hf_dir: Path, out: Path) -> Path:
    from optimum.exporters.openvino import main_export
    from optimum.exporters.openvino import model_configs

    # optimum-intel 2.1 caps these exports below the test venv's transformers as untested; the
    # exports are checked token for token against transformers by the tests that use them.
    for cls in (model_configs.Gemma3OpenVINOConfig, model_configs.Gemma3TextOpenVINOConfig,
                model_configs.Idefics3OpenVINOConfig, model_configs.SmolVLMOpenVINOConfig,
                model_configs.Qwen2VLOpenVINOConfig, model_configs.Qwen2_5_VLOpenVINOConfig):
        cls.MAX_TRANSFORMERS_VERSION = None
    # optimum collects garbage after each of its models: a third of a tiny export's time, in a
    # process holding the other tests' models; nothing here needs it
    with mock.patch("gc.collect"):
        main_export(str(hf_dir), output=out, task="image-text-to-text", convert_tokenizer=True)
    if not any((out / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        # optimum copies the processor it can build; the tiny Gemma 3's tokenizer lacks what
        # Gemma3Processor asks of a tokenizer (and the tiny Qwen-VL's gets none either), so its image
        # processor's config is copied as a hub model's is
        shutil.copy(hf_dir / "preprocessor_config.json", out)
    return out


def exports(tmp_path_factory) -> Callable[[str], tuple]:
    """family -> (HF model, its export's directory), each made once."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(f"vlm-{family}")
            hf = save_tiny_vlm(family, root / "hf")
            made[family] = hf, export_vlm(root / "hf", root / "ir")
        return made[family]

    return get


def f32_llm(ir: Path) -> LLM:
    """The export served at f32 (the precision exactness is claimed at)."""
    return LLM(EngineConfig(model=str(ir), compile=CompileOptions(inference_precision="f32", kv_cache_precision="f32"),
                            num_kv_blocks=32, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)),
               log=lambda m: None)


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB image of `size` (width, height), PNG-encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def served(llm: LLM, text: str, pngs: list[bytes]):
    """The prompt's ids and image spans as the server makes them from rendered text and images."""
    model = llm.engine.model
    refs = [ImageRef(f"data:image/png;base64,{base64.b64encode(p).decode()}", f"messages.0.content.{i}")
            for i, p in enumerate(pngs)]
    return asyncio.run(image_prompt(text, refs, model.vision, model.tokenizer, MediaPolicy()))
