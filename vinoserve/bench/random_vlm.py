"""Vision-language GGUF pairs with random weights at the sizes users serve (issue 58's speed
figures): a text GGUF and its mmproj GGUF side by side in one directory, as llama.cpp's releases
ship them (and as `vinoserve serve --model DIR/x.gguf` finds the projector).

    llava-1.5-7b-<type>-random   LLaVA 1.5 7B: Llama-2-7B text model; CLIP ViT-L/14 at 336 px, 23 of
                                 its 24 layers stored (the feature layer -2, as the legacy converter
                                 writes it: fc1 named ffn_down), mlp projector 1024 -> 4096 -> 4096
    smolvlm-500m-<type>-random   SmolVLM-500M: SmolLM2-360M text model; SigLIP base patch16 at 512
                                 px, 12 layers, pixel shuffle by 4, idefics3 projector 12288 -> 960
    qwen2.5-vl-3b-<type>-random  Qwen2.5-VL 3B: its Qwen2.5-3B text model with M-RoPE; its 32-layer ViT
                                 (patch 14, width 1280, window attention but every 8th layer), merger
                                 5120 -> 2048; images keep their aspect (28 px a row)

The text model's vocabulary is SmolLM2's (random_models.py) plus each family's image tokens as
control tokens: LLaVA-7B's real vocabulary (Llama-2's 32000) is not at hand, so its embedding and
LM head are 49153 rows instead of 32001 (about 1% of its weights). The mmproj is F16 as the
converters write it; weights ~N(0, 0.02), norms 1, biases 0.

    python -m vinoserve.bench.random_vlm smolvlm-500m-q8_0-random   # write both, print the text GGUF's path
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from vinoserve.bench import random_models
from vinoserve.bench.random_models import Shape, finish
from vinoserve.model.storage import cache_root

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
_IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>",
                    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


@dataclass(frozen=True)
class Tower:
    """A vision tower and its projector as an mmproj GGUF holds them."""

    projector: str  # "mlp" (LLaVA), "idefics3" or "qwen2.5vl_merger"
    image_size: int
    patch_size: int
    hidden: int
    ffn: int
    heads: int
    layers: int  # blocks stored (LLaVA: up to its feature layer)
    mm_hidden: int = 0  # mlp: the projector's inner width
    scale_factor: int = 1  # idefics3: the pixel shuffle's
    preproc_size: int = 0  # idefics3: the longest edge images are first resized to
    eps: float = 1e-5
    window_pattern: int = 0  # qwen2.5vl_merger: a full-attention layer every this many


@dataclass(frozen=True)
class VLM:
    text: Shape
    tower: Tower
    tokens: tuple[str, ...]  # the image tokens added to the vocabulary


VLMS = {
    "llava-1.5-7b": VLM(Shape("llama", 4096, 32, 32, 32, 128, 11008, 10000.0),
                        Tower("mlp", 336, 14, 1024, 4096, 16, 23, mm_hidden=4096), ("<image>",)),
    "smolvlm-500m": VLM(Shape("llama", 960, 32, 15, 5, 64, 2560, 100000.0),
                        Tower("idefics3", 512, 16, 768, 3072, 12, 12, scale_factor=4, preproc_size=2048, eps=1e-6),
                        _IDEFICS3_TOKENS),
    "qwen2.5-vl-3b": VLM(Shape("qwen2vl", 2048, 36, 16, 2, 128, 11008, 1e6),
                         Tower("qwen2.5vl_merger", 560, 14, 1280, 3420, 16, 32, mm_hidden=5120, eps=1e-6,
                               window_pattern=8),
                         ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")),
}


def tiny(name: str) -> VLM:
    """`name`'s family scaled down for tests: the same files' layout, a few MB."""
    vlm = VLMS[name]
    qwen = vlm.tower.projector == "qwen2.5vl_merger"
    text = Shape(vlm.text.arch, 64, 2, 4, 2, 16, 128)
    tower = replace(vlm.tower, image_size=32 if vlm.tower.projector == "mlp" else 64, patch_size=8, hidden=32, ffn=64,
                    heads=2, layers=2, mm_hidden=(128 if qwen else 48) if vlm.tower.mm_hidden else 0,
                    preproc_size=128 if vlm.tower.preproc_size else 0, window_pattern=2 if qwen else 0)
    return VLM(text, tower, vlm.tokens)


def names() -> list[str]:
    return [f"{family}-{t}-random" for family in VLMS for t in random_models.TYPES]


def resolve(model: str) -> tuple[str, str] | None:
    """The (text GGUF, mmproj GGUF) paths of a random VLM's name, written if missing; None for
    any other name."""
    if model not in names():
        return None
    family, qtype = model[:-len("-random")].rsplit("-", 1)
    where = cache_root() / "bench" / model
    text, mmproj = where / f"{model}.gguf", where / f"mmproj-{model}.gguf"
    if not (text.is_file() and mmproj.is_file()):
        write(VLMS[family], where, model, qtype)
    return str(text), str(mmproj)


def write(vlm: VLM, where: Path, stem: str, qtype: str = "q8_0", log=print) -> tuple[Path, Path]:
    """`stem`.gguf and mmproj-`stem`.gguf in `where`; the mmproj first (minutes less to wait for
    a mistake in it)."""
    mmproj = write_mmproj(vlm.tower, vlm.text.hidden, where / f"mmproj-{stem}.gguf")
    encode = random_models.q4_k_m(vlm.text.layers) if qtype == "q4_k_m" else \
        random_models.one_type(gguf.GGMLQuantizationType[qtype.upper()])
    text = random_models.write(where / f"{stem}.gguf", vlm.text, encode, log=log, extra_tokens=vlm.tokens)
    return text, mmproj


def write_mmproj(tower: Tower, text_hidden: int, path: Path) -> Path:
    """An mmproj GGUF in llama.cpp's key and tensor names (tools/mtmd/clip.cpp loads it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), "clip")
    _header(w, tower, text_hidden)
    rng = np.random.default_rng(1)
    tensors = _qwen_tensors if tower.projector == "qwen2.5vl_merger" else _tensors
    for name, value in tensors(tower, text_hidden, rng):
        # positions stay F32 as convert_hf_to_gguf forces them: ggml's CPU add takes no F16 operand
        half = value.ndim >= 2 and name != "v.position_embd.weight"
        w.add_tensor(name, value.astype(np.float16 if half else np.float32))
    return finish(w, part, path)


def _header(w: gguf.GGUFWriter, t: Tower, text_hidden: int) -> None:
    """The keys convert_hf_to_gguf.py (SmolVLM) or the legacy LLaVA converter write."""
    K, V = gguf.Keys.Clip, gguf.Keys.ClipVision
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_bool(K.HAS_VISION_ENCODER, True)
    w.add_string(K.PROJECTOR_TYPE, t.projector)
    w.add_uint32(V.PROJECTION_DIM, text_hidden)
    w.add_uint32(V.IMAGE_SIZE, t.image_size)
    w.add_uint32(V.PATCH_SIZE, t.patch_size)
    w.add_uint32(V.EMBEDDING_LENGTH, t.hidden)
    w.add_uint32(V.FEED_FORWARD_LENGTH, t.ffn)
    w.add_uint32(V.BLOCK_COUNT, t.layers)
    w.add_uint32(V.Attention.HEAD_COUNT, t.heads)
    w.add_float32(V.Attention.LAYERNORM_EPS, t.eps)
    llava, qwen = t.projector == "mlp", t.projector == "qwen2.5vl_merger"
    w.add_array(V.IMAGE_MEAN, list(CLIP_MEAN if llava or qwen else HALF))
    w.add_array(V.IMAGE_STD, list(CLIP_STD if llava or qwen else HALF))
    if qwen:  # Qwen2VLVisionModel's keys
        w.add_bool(V.USE_SILU, True)
        w.add_vision_n_wa_pattern(t.window_pattern)
        return
    w.add_bool(V.USE_GELU, not llava)  # CLIP's quick_gelu; SigLIP's gelu (tanh)
    if llava:  # the legacy converter's non-negative feature layer: every stored block runs
        w.add_array("clip.vision.feature_layer", [t.layers])
    else:
        w.add_uint32(V.Projector.SCALE_FACTOR, t.scale_factor)
        w.add_uint32(V.PREPROC_IMAGE_SIZE, t.preproc_size)


def _tensors(t: Tower, text_hidden: int, rng: np.random.Generator):
    """(llama.cpp name, array in Hugging Face's [out, in] order) of the tower and projector."""
    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    llava = t.projector == "mlp"
    patches = (t.image_size // t.patch_size) ** 2
    yield "v.patch_embd.weight", mat(t.hidden, 3, t.patch_size, t.patch_size)
    if llava:  # CLIP: a class token, a pre-layernorm, no patch bias
        yield "v.class_embd", mat(t.hidden)
        yield "v.pre_ln.weight", np.ones(t.hidden, np.float32)
        yield "v.pre_ln.bias", np.zeros(t.hidden, np.float32)
    else:
        yield "v.patch_embd.bias", np.zeros(t.hidden, np.float32)
    yield "v.position_embd.weight", mat(patches + llava, t.hidden)
    # the legacy LLaVA converter names fc1 ffn_down and fc2 ffn_up (clip.cpp swaps them back by shape)
    fc1, fc2 = ("ffn_down", "ffn_up") if llava else ("ffn_up", "ffn_down")
    for i in range(t.layers):
        p = f"v.blk.{i}."
        yield from _attention(p, t.hidden, mat)
        for name in ("ln1", "ln2"):
            yield p + name + ".weight", np.ones(t.hidden, np.float32)
            yield p + name + ".bias", np.zeros(t.hidden, np.float32)
        yield p + fc1 + ".weight", mat(t.ffn, t.hidden)
        yield p + fc1 + ".bias", np.zeros(t.ffn, np.float32)
        yield p + fc2 + ".weight", mat(t.hidden, t.ffn)
        yield p + fc2 + ".bias", np.zeros(t.hidden, np.float32)
    if llava:
        yield "mm.0.weight", mat(t.mm_hidden, t.hidden)
        yield "mm.0.bias", np.zeros(t.mm_hidden, np.float32)
        yield "mm.2.weight", mat(text_hidden, t.mm_hidden)
        yield "mm.2.bias", np.zeros(text_hidden, np.float32)
    else:  # SigLIP's post-layernorm, then the pixel-shuffled rows' linear map
        yield "v.post_ln.weight", np.ones(t.hidden, np.float32)
        yield "v.post_ln.bias", np.zeros(t.hidden, np.float32)
        yield "mm.model.fc.weight", mat(text_hidden, t.hidden * t.scale_factor ** 2)



def _attention(p: str, hidden: int, mat):
    """A tower layer's attention: Q, K, V and output matrices with (zero) biases."""
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        yield p + name + ".weight", mat(hidden, hidden)
        yield p + name + ".bias", np.zeros(hidden, np.float32)


def _qwen_tensors(t: Tower, text_hidden: int, rng: np.random.Generator):
    """Qwen2.5-VL's tower as Qwen2VLVisionModel writes it: the Conv3d split in two kernels, qkv split,
    RMSNorms, a gated SiLU MLP with biases, the merger's norm and two linears over 4 patches."""
    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    yield "v.patch_embd.weight", mat(t.hidden, 3, t.patch_size, t.patch_size)
    yield "v.patch_embd.weight.1", mat(t.hidden, 3, t.patch_size, t.patch_size)
    for i in range(t.layers):
        p = f"v.blk.{i}."
        yield from _attention(p, t.hidden, mat)
        for name in ("ln1", "ln2"):
            yield p + name + ".weight", np.ones(t.hidden, np.float32)
        for name, rows, cols in (("ffn_gate", t.ffn, t.hidden), ("ffn_up", t.ffn, t.hidden),
                                 ("ffn_down", t.hidden, t.ffn)):
            yield p + name + ".weight", mat(rows, cols)
            yield p + name + ".bias", np.zeros(rows, np.float32)
    yield "v.post_ln.weight", np.ones(t.hidden, np.float32)
    yield "mm.0.weight", mat(t.mm_hidden, t.mm_hidden)
    yield "mm.0.bias", np.zeros(t.mm_hidden, np.float32)
    yield "mm.2.weight", mat(text_hidden, t.mm_hidden)
    yield "mm.2.bias", np.zeros(text_hidden, np.float32)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["--help"]:
        found = resolve(arg)
        if found is None:
            raise SystemExit(f"random VLMs: {', '.join(names())}")
        print(found[0])
