"""Which vision projector a chat model is served with: `--mmproj`, else, as llama.cpp's server
finds one, the only `mmproj*.gguf` beside a `.gguf` model, or an image-text-to-text export's own
vision model. Loaded once at start."""
from __future__ import annotations

from pathlib import Path

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.vision.export import is_vision_export, load_export_vision
from vinoserve.model.vision.model import VisionModel, load_vision

# Projectors whose language model's image rows attend to each other both ways: Gemma 3's (HF's
# token_type_ids mask, llama.cpp's non-causal batch). The language model must have been compiled
# so (model/image_attention.py): causal attention there would answer otherwise than the model.
_BIDIRECTIONAL = frozenset({"gemma3"})


def find_mmproj(model: str | None, mmproj: str | None) -> Path | None:
    """The projector to load: the one asked for, or the lone mmproj*.gguf beside the model file,
    or an image-text-to-text export's own directory (vision/export.py)."""
    if mmproj is not None:
        return Path(mmproj)
    if model is not None and is_vision_export(Path(model).expanduser()):
        return Path(model).expanduser()
    if model is None or not model.endswith(".gguf") or not Path(model).is_file():
        return None
    found = sorted(Path(model).parent.glob("mmproj*.gguf"))
    return found[0] if len(found) == 1 else None


def load_projector(path: Path | None, image_width: int | None, precision: str, bidirectional: bool = False,
                   log=print) -> VisionModel | None:
    """The vision model of `path` for a language model taking image rows of `image_width`, at its
    precision (`bidirectional`: its image rows attend to each other both ways); ModelLoadError
    where it cannot serve this model's images."""
    if path is None:
        return None
    if image_width is None:
        raise ModelLoadError(f"{path}: this language model was compiled without image inputs")
    if is_vision_export(path):
        vision = load_export_vision(path, image_width, precision=precision)
    else:
        vision = load_vision(path, image_width, precision=precision)
    if (vision.projector in _BIDIRECTIONAL) != bidirectional:
        raise ModelLoadError(f"{path}: a {vision.projector} projector's image rows attend to each other "
                             f"{'both ways' if vision.projector in _BIDIRECTIONAL else 'causally'}, and this language "
                             f"model's {'causally' if vision.projector in _BIDIRECTIONAL else 'both ways'}")
    log(f"vision: {path.name} ({vision.projector} projector); chat messages may hold images")
    return vision
