"""From what a user names (nothing, a built-in name, a GGUF file, an IR dir) to a compiled model."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import openvino as ov

from vinoserve.model import default_model
from vinoserve.model.config import ModelConfig
from vinoserve.model.convert import converted_dir
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.weights import WeightFormat
from vinoserve.model.paged import CompileOptions, PagedModel, compile_paged
from vinoserve.model.tokenizer import Tokenizer


def resolve_model_dir(model: str | None, weight_format: WeightFormat = "auto", log=print) -> Path:
    """A directory holding openvino_model.xml, config.json and the tokenizer models."""
    name = model or default_model.DEFAULT_MODEL.name
    if name in default_model.BUILTIN_MODELS:
        return converted_dir(default_model.fetch(default_model.BUILTIN_MODELS[name], log), weight_format, log)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "openvino_model.xml").is_file():
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
    config: ModelConfig
    paged: PagedModel
    tokenizer: Tokenizer


def load_model(model: str | None = None, options: CompileOptions = CompileOptions(),
               weight_format: WeightFormat = "auto", log=print) -> LoadedModel:
    path = resolve_model_dir(model, weight_format, log)
    config = _read_config(path)
    core = ov.Core()
    paged = compile_paged(core.read_model(path / "openvino_model.xml"), config, options, core)
    return LoadedModel(path, config, paged, Tokenizer.from_ir_dir(path))


def _read_config(path: Path) -> ModelConfig:
    try:
        config = ModelConfig.from_dir(path)
    except (OSError, KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from e
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config = replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *extra])))
    return config
