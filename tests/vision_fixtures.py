"""Tiny random vision-language models (LLaVA 1.5, Gemma 3, Idefics3) and their mmproj GGUFs,
written as llama.cpp's converters write them: tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py
for LLaVA (its fc1 -> ffn_down / fc2 -> ffn_up naming, the last layer dropped, no post-layernorm,
the feature layer made non-negative), convert_hf_to_gguf.py's Gemma3VisionModel (soft_emb_norm
stored as 1 + w, the pool kernel as projector.scale_factor when not 4) and SmolVLMModel."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlamaConfig,
                          LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig)

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
                 projector: str | None = None) -> Path:
    """The model's mmproj GGUF. `matrices`: how matrices are stored (see _store).
    `feature_layer`: LLaVA's clip.vision.feature_layer key (files from CLIP-only directories lack
    it). `projector`: write another projector type's name (for refusals)."""
    cfg = model.config
    vision = cfg.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    if isinstance(model, LlavaForConditionalGeneration):
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


_VISION_PARTS = ("vision_tower", "multi_modal_projector", "vision_model", "connector")  # LLaVA/Gemma 3, Idefics3


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
