"""Which vision projector a chat model is served with: `--mmproj`, else, as llama.cpp's server
finds one, the only `mmproj*.gguf` beside a `.gguf` model. Loaded once at start."""
from __future__ import annotations

from pathlib import Path

from vinoserve.model.vision import VisionModel, load_vision


def find_mmproj(model: str | None, mmproj: str | None) -> Path | None:
    """The projector to load: the one asked for, or the lone mmproj*.gguf beside the model file."""
    if mmproj is not None:
        return Path(mmproj)
    if model is None or not model.endswith(".gguf") or not Path(model).is_file():
        return None
    found = sorted(Path(model).parent.glob("mmproj*.gguf"))
    return found[0] if len(found) == 1 else None


def load_projector(model: str | None, mmproj: str | None, text_hidden_size: int, precision: str,
                   log=print) -> VisionModel | None:
    path = find_mmproj(model, mmproj)
    if path is None:
        return None
    vision = load_vision(path, text_hidden_size, precision=precision)
    log(f"vision: {path.name} ({vision.projector} projector); chat messages may hold images")
    return vision
