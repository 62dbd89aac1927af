"""Tiny random vision-language models (LLaVA 1.5, Gemma 3, Idefics3, SmolVLM) saved as HF directories with
their tokenizer and image processor, and exported to OpenVINO IR as users export theirs:
optimum-intel's `main_export(..., task="image-text-to-text")`, what `optimum-cli export openvino
--task image-text-to-text` runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import torch
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration,
                          Gemma3ImageProcessorPil, Gemma3TextConfig, Idefics3Config, Idefics3ForConditionalGeneration,
                          Idefics3VisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, SiglipVisionConfig, SmolVLMConfig,
                          SmolVLMForConditionalGeneration, SmolVLMVisionConfig)

from ir_fixtures import hf_tokenizer
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
    vision = {"image_size": 32, "patch_size": 8, "num_hidden_layers": 2, **_TOWER}
    if family == "smolvlm":
        return SmolVLMForConditionalGeneration(SmolVLMConfig(
            vision_config=SmolVLMVisionConfig(**vision), text_config=LlamaConfig(vocab_size=vocab, **_TEXT),
            scale_factor=2, image_token_id=ids["<image>"]))
    return Idefics3ForConditionalGeneration(Idefics3Config(
        vision_config=Idefics3VisionConfig(**vision), text_config=LlamaConfig(vocab_size=vocab, **_TEXT),
        scale_factor=2, image_token_id=ids["<image>"]))


def image_processor(family: str):
    """The family's HF image processor at the tiny towers' 32 px (LLaVA's and Gemma 3's)."""
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
                model_configs.Idefics3OpenVINOConfig, model_configs.SmolVLMOpenVINOConfig):
        cls.MAX_TRANSFORMERS_VERSION = None
    # optimum collects garbage after each of its models: a third of a tiny export's time, in a
    # process holding the other tests' models; nothing here needs it
    with mock.patch("gc.collect"):
        main_export(str(hf_dir), output=out, task="image-text-to-text", convert_tokenizer=True)
    if not any((out / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        # optimum copies the processor it can build; the tiny Gemma 3's tokenizer lacks what
        # Gemma3Processor asks of a tokenizer, so its image processor's config is copied as a hub model's is
        shutil.copy(hf_dir / "preprocessor_config.json", out)
    return out
