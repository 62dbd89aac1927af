"""Tiny random vision-language models (LLaVA 1.5, Gemma 3, Idefics3, Qwen2-VL, Qwen2.5-VL) and
their mmproj GGUFs, written as llama.cpp's converters write them:
tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py for LLaVA (its fc1 -> ffn_down / fc2 ->
ffn_up naming, the last layer dropped, no post-layernorm, the feature layer made non-negative),
convert_hf_to_gguf.py's Gemma3VisionModel (soft_emb_norm stored as 1 + w, the pool kernel as
projector.scale_factor when not 4), SmolVLMModel and Qwen2VLVisionModel (the Conv3d split into two
per-frame kernels, qkv split in three, n_wa_pattern from fullatt_block_indexes)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from PIL import Image
from transformers import (CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlamaConfig,
                          LlavaConfig, LlavaForConditionalGeneration, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                          SiglipVisionConfig)

TEXT_HIDDEN = 48
_TEXT = {"vocab_size": 64, "hidden_size": TEXT_HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1}
_TOWER = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 2}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]
# A layer's tensors: HF name within the tower's encoder layer -> llama.cpp's (convert_hf_to_gguf)
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2",
          "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
_LEGACY_FFN = {"mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up"}  # convert_image_encoder_to_gguf.py's names
_EMBED = {"embeddings.class_embedding": "v.class_embd", "embeddings.patch_embedding": "v.patch_embd",
          "embeddings.position_embedding": "v.position_embd", "pre_layrnorm": "v.pre_ln",
          "post_layernorm": "v.post_ln"}


def odd_images() -> list[Image.Image]:
    """Odd sizes and modes: transparent RGBA, grayscale, a palette with a transparent index,
    a tall RGB smaller than the towers' 32 px on one side."""
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (37, 50, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (80, 80), dtype=np.uint8), "L")
    palette = Image.fromarray(rng.integers(0, 16, (45, 45), dtype=np.uint8), "P")
    palette.putpalette(list(rng.integers(0, 256, 16 * 3, dtype=np.uint8)))
    palette.info["transparency"] = 3
    tall = Image.fromarray(rng.integers(0, 256, (90, 21, 3), dtype=np.uint8), "RGB")
    return [rgba, gray, palette, tall]


def _randomize(model, seed: int) -> None:
    """Every weight random (HF zero-initialises some, e.g. Gemma's norm offsets), norms near 1 so
    the states stay in range over the layers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if ("norm" in name and name.endswith("weight")) else 0.2 * noise)


def tiny_llava(seed: int = 0, layers: int = 3) -> LlavaForConditionalGeneration:
    vision = CLIPVisionConfig(image_size=32, patch_size=8, num_hidden_layers=layers, projection_dim=16, **_TOWER)
    cfg = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_TEXT), image_token_index=63)
    model = LlavaForConditionalGeneration(cfg).eval()
    _randomize(model, seed)
    return model


def tiny_gemma3(seed: int = 0) -> Gemma3ForConditionalGeneration:
    vision = SiglipVisionConfig(image_size=32, patch_size=4, num_hidden_layers=2, **_TOWER)
    cfg = Gemma3Config(vision_config=vision, text_config=Gemma3TextConfig(**_TEXT, head_dim=24), mm_tokens_per_image=4,
                       image_token_index=60, boi_token_index=61, eoi_token_index=62)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model, seed)
    return model


def tiny_idefics3(seed: int = 0) -> Idefics3ForConditionalGeneration:
    vision = Idefics3VisionConfig(image_size=32, patch_size=8, num_hidden_layers=2, **_TOWER)
    model = Idefics3ForConditionalGeneration(Idefics3Config(vision_config=vision, text_config=LlamaConfig(**_TEXT),
                                                            scale_factor=2)).eval()
    _randomize(model, seed)
    return model


# Qwen-VL's special tokens within the tiny vocabulary (HF's ids are past it), and a text model
# whose M-RoPE sections (t, h, w) fill its head_dim / 2 = 12 rotary pairs, unevenly as the real ones
QWEN_TOKENS = {"image_token_id": 60, "video_token_id": 61, "vision_start_token_id": 62, "vision_end_token_id": 63}
_QWEN_TEXT = {**_TEXT, "bos_token_id": 1, "eos_token_id": 2,
              "rope_parameters": {"rope_type": "default", "mrope_section": [2, 5, 5], "rope_theta": 1e6}}


def tiny_qwen2vl(seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """Qwen2-VL: 2 layers of LayerNorm + quick_gelu MLP, every one attending over the whole image."""
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": TEXT_HIDDEN, "mlp_ratio": 2, "num_heads": 2}
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=_QWEN_TEXT,
                                                          **QWEN_TOKENS)).eval()
    _randomize(model, seed)
    return model


def tiny_qwen25vl(seed: int = 0, window_size: int = 112) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL: 4 layers of RMSNorm + SiLU-gated MLP, layers 1 and 3 attending over the whole
    image, 0 and 2 within windows of `window_size` pixels (112: 4 x 4 merged rows)."""
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN,
              "fullatt_block_indexes": [1, 3], "window_size": window_size}
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, text_config=_QWEN_TEXT,
                                                                **QWEN_TOKENS)).eval()
    _randomize(model, seed)
    return model


_QWEN_LAYER = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QWEN_MERGER = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}


def _qwen_tensors(visual):
    """(llama.cpp name, array) of a Qwen-VL tower and merger, as Qwen2VLVisionModel.modify_tensors
    names and splits them."""
    for name, t in visual.state_dict().items():
        a = t.float().numpy()
        base, _, part = name.rpartition(".")
        if name == "patch_embed.proj.weight":
            yield "v.patch_embd.weight", np.ascontiguousarray(a[:, :, 0])
            yield "v.patch_embd.weight.1", np.ascontiguousarray(a[:, :, 1])
        elif base.startswith("blocks."):
            i, _, rest = base[len("blocks."):].partition(".")
            if rest == "attn.qkv":
                for kind, third in zip(("attn_q", "attn_k", "attn_v"), np.split(a, 3)):
                    yield f"v.blk.{i}.{kind}.{part}", third
            else:
                yield f"v.blk.{i}.{_QWEN_LAYER[rest]}.{part}", a
        else:
            yield f"{_QWEN_MERGER[base]}.{part}", a


def _qwen_header(w: gguf.GGUFWriter, model, projector: str | None, pixels: tuple[int, int] | None) -> None:
    """Qwen2VLVisionModel's keys: image_size 560 (no input size), 2-VL's embed_dim as the width,
    the text model's rms_norm_eps (1e-6) as the layers' eps; 2.5-VL's use_silu and n_wa_pattern;
    `pixels`: image_min_pixels / image_max_pixels (the converter writes none)."""
    vision = model.config.vision_config
    qwen25 = isinstance(model, Qwen2_5_VLForConditionalGeneration)
    width = vision.hidden_size if qwen25 else vision.embed_dim
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector or ("qwen2.5vl_merger" if qwen25 else "qwen2vl_merger"))
    w.add_uint32(gguf.Keys.ClipVision.PROJECTION_DIM, model.config.text_config.hidden_size)
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_SIZE, 560)
    w.add_uint32(gguf.Keys.ClipVision.PATCH_SIZE, vision.patch_size)
    w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, width)
    w.add_uint32(gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, vision.intermediate_size if qwen25 else vision.hidden_size)
    w.add_uint32(gguf.Keys.ClipVision.BLOCK_COUNT, vision.depth)
    w.add_uint32(gguf.Keys.ClipVision.Attention.HEAD_COUNT, vision.num_heads)
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, 1e-6)
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, CLIP_MEAN)
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, CLIP_STD)
    if qwen25:
        w.add_bool(gguf.Keys.ClipVision.USE_SILU, True)
        w.add_uint32(gguf.Keys.ClipVision.N_WA_PATTERN, vision.fullatt_block_indexes[0] + 1)
        if vision.window_size != 112:  # the converter writes none: clip.cpp's 112 stands
            w.add_uint32(gguf.Keys.ClipVision.WINDOW_SIZE, vision.window_size)
    if pixels:
        w.add_uint32(gguf.Keys.ClipVision.IMAGE_MIN_PIXELS, pixels[0])
        w.add_uint32(gguf.Keys.ClipVision.IMAGE_MAX_PIXELS, pixels[1])


def _tower_tensors(tower, layers: int, legacy: bool):
    """(llama.cpp name, array) of a vision tower's first `layers` layers and embeddings/norms."""
    for name, t in tower.state_dict().items():
        a = t.float().numpy()
        base, _, part = name.rpartition(".")
        if base.startswith("encoder.layers."):
            i, _, rest = base[len("encoder.layers."):].partition(".")
            if int(i) < layers:
                kind = _LEGACY_FFN.get(rest, _LAYER[rest]) if legacy else _LAYER[rest]
                yield f"v.blk.{i}.{kind}.{part}", a
        elif name == "embeddings.class_embedding":
            yield _EMBED[name], a
        elif base in _EMBED and not (legacy and base == "post_layernorm"):  # LLaVA skips it
            yield f"{_EMBED[base]}.{part}", a


def _header(w: gguf.GGUFWriter, vision, projector: str, blocks: int, mean, std, text_hidden: int) -> None:
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector)
    w.add_uint32(gguf.Keys.ClipVision.PROJECTION_DIM, text_hidden)
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_SIZE, vision.image_size)
    w.add_uint32(gguf.Keys.ClipVision.PATCH_SIZE, vision.patch_size)
    w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, vision.hidden_size)
    w.add_uint32(gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, vision.intermediate_size)
    w.add_uint32(gguf.Keys.ClipVision.BLOCK_COUNT, blocks)
    w.add_uint32(gguf.Keys.ClipVision.Attention.HEAD_COUNT, vision.num_attention_heads)
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, mean)
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, std)
    w.add_bool(gguf.Keys.ClipVision.USE_GELU, vision.hidden_act != "quick_gelu")


def _store(w: gguf.GGUFWriter, name: str, a: np.ndarray, matrices: str) -> None:
    """Vectors f32; matrices as `matrices` says: F32, F16 (the converters' default) or Q8_0
    (llama-quantize's, for rows of whole 32-blocks; the rest stay F16)."""
    if a.ndim < 2 or matrices == "F32":
        w.add_tensor(name, a.astype(np.float32))
    elif matrices == "Q8_0" and a.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, a.astype(np.float16))


def as_stored(a: np.ndarray, matrices: str) -> np.ndarray:
    """A weight's values as `_store` keeps them: the reference model's weights for such a file."""
    if a.ndim < 2 or matrices == "F32":
        return a
    if matrices == "Q8_0" and a.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(gguf.quants.quantize(a.astype(np.float32), qtype), qtype).reshape(a.shape)
    return a.astype(np.float16).astype(np.float32)


def write_mmproj(model, path: Path, *, matrices: str = "F32", feature_layer: bool = True,
                 projector: str | None = None, pixels: tuple[int, int] | None = None) -> Path:
    """The model's mmproj GGUF. `matrices`: how matrices are stored (see _store).
    `feature_layer`: LLaVA's clip.vision.feature_layer key (files from CLIP-only directories lack
    it). `projector`: write another projector type's name (for refusals). `pixels`: Qwen-VL's
    (min, max) pixels an image is resized within (else clip.cpp's 8 to 4096 merged rows)."""
    cfg = model.config
    vision = cfg.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    if isinstance(model, (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)):
        _qwen_header(w, model, projector, pixels)
        tensors = list(_qwen_tensors(model.model.visual))
    elif isinstance(model, LlavaForConditionalGeneration):
        feature = vision.num_hidden_layers + cfg.vision_feature_layer + 1  # the converter's non-negative index
        _header(w, vision, projector or "mlp", feature, CLIP_MEAN, CLIP_STD, cfg.text_config.hidden_size)
        if feature_layer:
            w.add_array("clip.vision.feature_layer", [feature])  # no gguf-py constant: the converter spells it
        tensors = list(_tower_tensors(model.model.vision_tower, feature, legacy=True))
        proj = model.model.multi_modal_projector
        for hf, ours in (("linear_1", "mm.0"), ("linear_2", "mm.2")):
            tensors += [(f"{ours}.{p}", getattr(proj, hf).state_dict()[p].numpy()) for p in ("weight", "bias")]
    elif isinstance(model, Gemma3ForConditionalGeneration):
        _header(w, vision, projector or "gemma3", vision.num_hidden_layers, HALF, HALF, cfg.text_config.hidden_size)
        kernel = (vision.image_size // vision.patch_size) // int(cfg.mm_tokens_per_image ** 0.5)
        if kernel != 4:
            w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, kernel)
        tensors = list(_tower_tensors(model.model.vision_tower, vision.num_hidden_layers, legacy=False))
        proj = model.model.multi_modal_projector
        tensors += [("mm.input_projection.weight", proj.mm_input_projection_weight.detach().numpy()),
                    ("mm.soft_emb_norm.weight", proj.mm_soft_emb_norm.weight.detach().numpy() + 1.0)]
    else:
        _header(w, vision, projector or "idefics3", vision.num_hidden_layers, HALF, HALF, cfg.text_config.hidden_size)
        w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, cfg.scale_factor)
        w.add_uint32(gguf.Keys.ClipVision.PREPROC_IMAGE_SIZE, 2 * vision.image_size)
        tensors = list(_tower_tensors(model.model.vision_model, vision.num_hidden_layers, legacy=False))
        tensors.append(("mm.model.fc.weight", model.model.connector.modality_projection.proj.weight.detach().numpy()))
    for name, a in tensors:
        _store(w, name, a, matrices)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@contextlib.contextmanager
def pieces_fed(runner) -> Iterator[list[int]]:
    """The rows of each piece of an image an engine's ModelRunner is fed while inside."""
    seen, prepare = [], runner.prepare

    def spy(chunks, rotation=None):
        seen.extend(len(rows) for c in chunks for _, rows in c.images)
        return prepare(chunks, rotation)

    runner.prepare = spy
    try:
        yield seen
    finally:
        del runner.prepare


# LLaVA/Gemma 3, Idefics3, Qwen-VL
_VISION_PARTS = ("vision_tower", "multi_modal_projector", "vision_model", "connector", "visual")


def with_text_model(hf, text, seed: int = 3) -> None:
    """In place: a vision-language model's tower and projector random (norms near 1, other
    weights at 0.3, rows of the text embeddings' scale), its language model and LM head
    `text`'s (a tiny_hf_model), EOS just another token (as with ignore_eos)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(part in name for part in _VISION_PARTS):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name and name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=g))
    language = getattr(hf.model, "language_model", None) or hf.model.text_model  # Idefics3 names it text_model
    language.load_state_dict(text.model.state_dict())
    hf.lm_head.load_state_dict(text.lm_head.state_dict())
    hf.generation_config.eos_token_id = None
