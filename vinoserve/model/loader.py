"""From what a user names (nothing, a built-in name, a GGUF file, an IR dir) to a compiled model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from vinoserve.memory import anonymous_bytes, reclaimable_room_bytes, release_freed_heap
from vinoserve.model import default_model, vlm_export
from vinoserve.model.architectures.phi3 import pin_longrope
from vinoserve.model.convert import converted_dir
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.image_attention import bidirectional_images, max_image_rows
from vinoserve.model.image_inputs import ImageRules
from vinoserve.model.weights import WeightFormat
from vinoserve.model.paged import PagedModel, compile_paged
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.precision import check_inference_precision
from vinoserve.model.spec import ModelSpec, read_config
from vinoserve.model.tokenizer import DETOKENIZER_XML, TOKENIZER_XML, Tokenizer
from vinoserve.model.vision.model import VisionModel
from vinoserve.model.vision.serving import load_projector


def resolve_model_dir(model: str | None, weight_format: WeightFormat = "auto", log=print) -> Path:
    """A directory holding openvino_model.xml (or an image-text-to-text export's language and text
    embeddings models: model/vlm_export.py), config.json and the tokenizer models."""
    name = model or default_model.DEFAULT_MODEL.name
    if name in default_model.BUILTIN_MODELS:
        return converted_dir(default_model.fetch(default_model.BUILTIN_MODELS[name], log), weight_format, log)
    path = Path(name).expanduser()
    if path.is_dir():
        if vlm_export.is_vlm_export(path):
            vlm_export.check_family(path)
        elif not (path / "openvino_model.xml").is_file():
            raise ModelLoadError(f"{path} has no openvino_model.xml (expected an optimum-cli export)")
        return path
    if path.suffix == ".gguf" or path.is_file():
        return converted_dir(path, weight_format, log)
    raise ModelLoadError(
        f"model not found: {name!r} (give a .gguf file, an OpenVINO IR directory, "
        f"or a built-in name: {', '.join(default_model.BUILTIN_MODELS)})"
    )


@dataclass
class LoadedModel:
    path: Path
    config: ModelSpec
    paged: PagedModel
    tokenizer: Tokenizer
    vision: VisionModel | None = None  # its vision tower and projector, where it takes images
    # what loading added to the process' anonymous memory: the weights as compiled (packed; a
    # decode model's copy, the tokenizer and a vision tower included), not their files' size; 0
    # where /proc cannot tell
    held_bytes: int = 0

    @property
    def weight_files(self) -> tuple[Path, ...]:
        """The files its language model's weights were read from."""
        return weight_files(self.path)

    @property
    def bidirectional_rows(self) -> int | None:
        """Its image rows attend to each other both ways, in images of at most this many rows
        (model/image_attention.py); None: causally."""
        if not self.paged.bidirectional_images:
            return None
        return max_image_rows(self.config.sliding_windows, self.config.max_context)

    @property
    def image_rules(self) -> ImageRules:
        return ImageRules(self.paged.image_width, self.bidirectional_rows, self.paged.image_grids)


def weight_files(model_dir: Path) -> tuple[Path, ...]:
    if vlm_export.is_vlm_export(model_dir):
        return vlm_export.weight_files(model_dir)
    return (model_dir / "openvino_model.bin",)


def check_fits(model_dir: Path, given: str | None) -> None:
    """One clear error, before a compile the OOM killer would end (no line, exit 137), where
    the weights cannot fit: at least the GGUF's bytes (the low-bit kernel holds them as the file
    does) or the IR's, against what the machine could free for them."""
    need = sum(f.stat().st_size for f in weight_files(model_dir) if f.is_file())
    gguf = Path(given).expanduser() if given else None
    if gguf is not None and gguf.suffix == ".gguf" and gguf.is_file():
        need = min(need, gguf.stat().st_size)
    room = reclaimable_room_bytes()
    if need > room:
        raise ModelLoadError(f"the model's weights need at least {need / 2**30:.1f} GiB of memory and "
                             f"{room / 2**30:.1f} GiB is available (MemAvailable, or the container's limit): "
                             f"a smaller quantization of it, or more memory")


def load_model(model: str | None = None, options: CompileOptions = CompileOptions(),
               weight_format: WeightFormat = "auto", log=print, mmproj: Path | None = None) -> LoadedModel:
    """`mmproj`: a vision projector GGUF for it (model/vision), compiled at its precision."""
    check_inference_precision(options)  # before a conversion that may take a minute
    before = anonymous_bytes()
    path = resolve_model_dir(model, weight_format, log)
    check_fits(path, model)
    config = read_config(path)  # what can be missing is found before the compile, which takes a while
    core = ov.Core()
    tokenizer = _tokenizer(path, core)
    graph = _read_model(core, path)
    if config.rope is not None and config.rope.freq_factors is not None:
        pin_longrope(graph, config.rope)
    paged = compile_paged(graph, options, core, config.sliding_windows, bidirectional_images(config.architecture))
    vision = load_projector(mmproj, paged.image_width, paged.inference_precision, paged.bidirectional_images, log)
    release_freed_heap()  # the load's temporaries, out of the count
    return LoadedModel(path, ModelSpec.of(paged.facts, config), paged, tokenizer, vision,
                       max(0, anonymous_bytes() - before))


def _tokenizer(path: Path, core: ov.Core) -> Tokenizer:
    missing = [name for name in (TOKENIZER_XML, DETOKENIZER_XML) if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(f"{path} has no {' or '.join(missing)} (optimum-cli exports them unless told "
                             f"--disable-convert-tokenizer; openvino_tokenizers' convert_tokenizer makes them)")
    try:
        return Tokenizer.from_ir_dir(path, core)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the tokenizer cannot be loaded: {last_line(e)}") from e


def _read_model(core: ov.Core, path: Path) -> ov.Model:
    if vlm_export.is_vlm_export(path):
        return vlm_export.read_language_model(core, path)
    try:
        return core.read_model(path / "openvino_model.xml")
    except RuntimeError as e:
        raise ModelLoadError(f"{path}/openvino_model.xml cannot be read (truncated or corrupt?): "
                             f"{last_line(e)}") from e

