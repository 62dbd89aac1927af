"""An mmproj GGUF read as llama.cpp's tools/mtmd/clip.cpp reads it: the projector type, the vision
tower's shape, its preprocessing constants, and its weights by llama.cpp's tensor names (rows in
Hugging Face's [out, in] order)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta, open_gguf

QWEN_PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger")
PROJECTORS = ("mlp", "gemma3", "idefics3", *QWEN_PROJECTORS)
_V = "clip.vision."
# clip.cpp's Qwen-VL defaults where a file has no key: HF's window (112 px a side) and 2x2 merge,
# and set_limit_image_tokens(8, 4096): 8 to 4096 merged rows an image
_QWEN_WINDOW, _QWEN_MERGE, _QWEN_TOKENS = 112, 2, (8, 4096)
# projector.scale_factor where a file has none, as clip.cpp assumes: Gemma 3's pool kernel (4 for
# every released size; only test models write it) and Idefics3's pixel shuffle
_SCALE = {"gemma3": 4, "idefics3": 2}


@dataclass(frozen=True)
class VisionConfig:
    projector: str  # one of PROJECTORS
    image_size: int  # the tower's square input, pixels a side
    patch_size: int
    hidden_size: int
    num_heads: int
    num_layers: int  # the layers the tower runs (the feature layer, see _layers_run)
    layer_norm_eps: float
    activation: str  # the tower's MLP: "quick_gelu", "gelu" (erf), "gelu_tanh" or "silu"
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    scale_factor: int  # gemma3: the average pool's kernel; idefics3: the pixel shuffle's; mlp: 1
    preproc_longest_edge: int  # idefics3: the first resize's longest edge
    dynamic: DynamicSize | None = None  # Qwen-VL: images keep their aspect (image_size is no input size)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        """Embedding rows per image."""
        return (self.patches_per_side // self.scale_factor) ** 2


@dataclass(frozen=True)
class DynamicSize:
    """Qwen-VL's towers: each image at its own size (a multiple of patch x merge a side, its area
    within min..max pixels), 2x2 patches merged into one row, 2.5-VL's windowed attention."""
    merge: int  # spatial merge: merge x merge patches become one row
    min_pixels: int
    max_pixels: int
    window_size: int  # 2.5-VL: windows of this many pixels a side on windowed layers
    wa_pattern: int  # 2.5-VL: every wa_pattern-th layer attends fully, the others in windows; 0: all fully

    def full_attention(self, layer: int) -> bool:
        return not self.wa_pattern or (layer + 1) % self.wa_pattern == 0

    @property
    def windowed(self) -> bool:
        """Whether some layer attends in windows (layer 0 does unless every layer is full)."""
        return not self.full_attention(0)


class MMProj:
    """The weights of an mmproj file by llama.cpp's names, float32 or (as stored) float16."""

    def __init__(self, meta: GGUFMeta, config: VisionConfig) -> None:
        self.meta, self.config, self.path = meta, config, meta.path
        self._renamed = _ffn_swaps(meta, config)

    def has(self, name: str) -> bool:
        return self.meta.has(self._renamed.get(name, name))

    def weight(self, name: str) -> np.ndarray:
        t = self.meta.tensor(self._renamed.get(name, name))
        if t.ggml_type == gguf.GGMLQuantizationType.F16:  # kept half: the graph converts it on the fly
            return np.ascontiguousarray(t.data.view(np.float16).reshape(t.shape))
        return t.dequantize()


def read_mmproj(path: Path) -> MMProj:
    reader = open_gguf(path)
    meta = GGUFMeta(path, reader, {t.name: t for t in reader.tensors}, "clip")
    arch = meta.field("general.architecture")
    if arch != "clip":
        raise ModelLoadError(f"{path} is not a vision projector (mmproj) GGUF: its architecture is {arch!r}, not "
                             "'clip'; pass the mmproj file llama.cpp ships beside the model")
    projector = meta.field(_V + "projector_type") or meta.field("clip.projector_type")
    if projector is None or not meta.field("clip.has_vision_encoder", True):
        raise ModelLoadError(f"{path} is an mmproj GGUF without a vision encoder (no clip.projector_type)")
    if projector not in PROJECTORS:
        raise ModelLoadError(f"{path}: vision projector type {projector!r} is not supported "
                             f"(supported: {', '.join(PROJECTORS)})")
    return MMProj(meta, _config(meta, projector))


def _config(meta: GGUFMeta, projector: str) -> VisionConfig:
    def need(key: str):
        value = meta.field(_V + key)
        if value is None:
            raise ModelLoadError(f"{meta.path}: metadata key {_V + key} is missing")
        return value

    image_size, patch_size = int(need("image_size")), int(need("patch_size"))
    hidden, blocks = int(need("embedding_length")), int(need("block_count"))
    mean, std = need("image_mean"), need("image_std")
    default_scale = _SCALE.get(projector)
    scale = int(meta.field(_V + "projector.scale_factor", default_scale)) if default_scale else 1
    config = VisionConfig(
        projector=projector, image_size=image_size, patch_size=patch_size, hidden_size=hidden,
        num_heads=int(need("attention.head_count")), num_layers=_layers_run(meta, projector, blocks),
        layer_norm_eps=float(need("attention.layer_norm_epsilon")), activation=_activation(meta, projector),
        image_mean=tuple(float(v) for v in mean), image_std=tuple(float(v) for v in std), scale_factor=scale,
        preproc_longest_edge=int(meta.field(_V + "preproc_image_size", image_size)),
        dynamic=_dynamic(meta, projector, patch_size) if projector in QWEN_PROJECTORS else None)
    _check(meta, config)
    return config


def _dynamic(meta: GGUFMeta, projector: str, patch: int) -> DynamicSize:
    merge = int(meta.field(_V + "spatial_merge_size", _QWEN_MERGE))
    unit = (patch * merge) ** 2  # pixels per merged row
    pattern = meta.field(_V + "n_wa_pattern")
    if projector == "qwen2.5vl_merger" and not pattern:
        raise ModelLoadError(f"{meta.path}: a Qwen2.5-VL projector without {_V}n_wa_pattern (which layers attend "
                             "in windows); convert it again with llama.cpp's convert_hf_to_gguf.py")
    size = DynamicSize(merge=merge, min_pixels=int(meta.field(_V + "image_min_pixels", _QWEN_TOKENS[0] * unit)),
                       max_pixels=int(meta.field(_V + "image_max_pixels", _QWEN_TOKENS[1] * unit)),
                       window_size=int(meta.field(_V + "window_size", _QWEN_WINDOW)),
                       wa_pattern=int(pattern or 0) if projector == "qwen2.5vl_merger" else 0)
    window_too_small = size.windowed and size.window_size < patch * merge  # HF's windows would be empty
    if merge < 1 or not 0 < size.min_pixels <= size.max_pixels or window_too_small:
        raise ModelLoadError(f"{meta.path}: Qwen-VL sizes out of range: merge {merge}, pixels {size.min_pixels}.."
                             f"{size.max_pixels}, window {size.window_size} px for {patch} px patches")
    return size


def _layers_run(meta: GGUFMeta, projector: str, blocks: int) -> int:
    """LLaVA reads the tower at HF's vision_feature_layer (-2: all layers but the last). The
    legacy converter stores only the layers up to it (block_count = num_layers - 1) and names it
    in clip.vision.feature_layer when the config had one; without the key, every stored block
    runs. llama.cpp's graph runs one block fewer there (ggml-org/llama.cpp#25817, a bug); this
    follows the model as trained. SigLIP towers run every block."""
    if projector != "mlp":
        return blocks
    layers = meta.field(_V + "feature_layer")
    if not layers:
        return blocks
    if len(layers) > 1:
        raise ModelLoadError(f"{meta.path}: several vision feature layers {list(layers)} (stacked features) "
                             "are not supported")
    return int(layers[0])


def _activation(meta: GGUFMeta, projector: str) -> str:
    if meta.field("clip.use_silu", False):
        return "silu"
    if meta.field("clip.use_gelu", False):
        # SigLIP's MLP is gelu_pytorch_tanh; a CLIP config saying "gelu" means the erf form
        return "gelu" if projector == "mlp" else "gelu_tanh"
    return "quick_gelu"


def _check(meta: GGUFMeta, cfg: VisionConfig) -> None:
    # Qwen-VL's image_size is no input size (its images keep their own): only its width need divide
    if (cfg.image_size % cfg.patch_size and not cfg.dynamic) or cfg.hidden_size % cfg.num_heads:
        raise ModelLoadError(f"{meta.path}: image size {cfg.image_size} / patch size {cfg.patch_size} / width "
                             f"{cfg.hidden_size} / {cfg.num_heads} heads do not divide evenly")
    if cfg.patches_per_side % cfg.scale_factor:
        raise ModelLoadError(f"{meta.path}: {cfg.patches_per_side} patches a side do not divide by the "
                             f"projector's scale factor {cfg.scale_factor}")
    if not 0 < cfg.num_layers or not meta.has(f"v.blk.{cfg.num_layers - 1}.attn_q.weight"):
        raise ModelLoadError(f"{meta.path}: the tower runs {cfg.num_layers} layers but the file does not hold "
                             f"them (v.blk.{cfg.num_layers - 1}.* missing)")
    if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
        raise ModelLoadError(f"{meta.path}: image_mean and image_std need 3 values each")
    if cfg.dynamic and not meta.has("v.patch_embd.weight.1"):
        raise ModelLoadError(f"{meta.path}: a Qwen-VL projector without v.patch_embd.weight.1 (the patch "
                             "convolution's second frame)")


def _ffn_swaps(meta: GGUFMeta, cfg: VisionConfig) -> dict[str, str]:
    """llama.cpp's legacy LLaVA converter wrote fc1 as ffn_down and fc2 as ffn_up; clip.cpp swaps
    them back where ffn_down takes the tower's width, and so does this (only LLaVA's files: a
    tower whose MLP is as wide as itself would look swapped)."""
    renamed: dict[str, str] = {}
    for i in range(cfg.num_layers if cfg.projector == "mlp" else 0):
        down = meta.tensors.get(f"v.blk.{i}.ffn_down.weight")
        if down is not None and int(down.shape[0]) == cfg.hidden_size:  # gguf's shape is [in, out]
            for part in ("weight", "bias"):
                up, dn = f"v.blk.{i}.ffn_up.{part}", f"v.blk.{i}.ffn_down.{part}"
                renamed[up], renamed[dn] = dn, up
    return renamed
