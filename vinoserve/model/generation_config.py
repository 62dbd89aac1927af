"""The sampling defaults a model ships with, for every field a request leaves out.

Like vLLM's `--generation-config auto`: the sampling fields of an IR directory's
`generation_config.json` (as written by the model's authors), a GGUF's `general.sampling.*`
metadata, and for a built-in model the values its authors recommend. `vinoserve` ignores them (OpenAI's defaults); a directory reads that
directory's `generation_config.json` instead. `--override-generation-config` goes on top.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from vinoserve.model import default_model
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import open_gguf

GENERATION_CONFIG_MODES = ("auto", "vinoserve")  # or a directory with a generation_config.json
# generation_config.json key -> request field; max_new_tokens is HF's name for max_tokens.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTEGER = {"top_k", "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}


@dataclass(frozen=True)
class GenerationDefaults:
    """None: the field falls back to OpenAI's default (temperature 1, top_p 1, no top_k...)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # chat only: completions keep OpenAI's 16
    source: str = ""  # where the values came from, for the log

    @classmethod
    def from_generation_config(cls, config: Mapping, source: str) -> GenerationDefaults:
        """The sampling fields of a generation_config.json-shaped dict; other keys are ignored."""
        values = {}
        for key, field in _KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    field in _INTEGER and value != int(value)):
                raise ModelLoadError(f"{source}: {key} must be a {'whole ' if field in _INTEGER else ''}number, "
                                     f"got {value!r}")
            values[field] = int(value) if field in _INTEGER else float(value)
        return cls(**values, source=source)

    def values(self) -> dict[str, float | int]:
        """The fields that are set, by request field name."""
        return {k: v for k, v in asdict(self).items() if k != "source" and v is not None}

    def describe(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.values().items())
        return f"{values} (from {self.source}); the rest OpenAI's" if values else "none (OpenAI's)"

    def overridden(self, other: GenerationDefaults) -> GenerationDefaults:
        """These values with `other`'s on top."""
        if not other.values():
            return self
        if not self.values():
            return other
        return GenerationDefaults(**{**self.values(), **other.values()}, source=f"{self.source} + {other.source}")


def load_generation_defaults(mode: str, model: str | None, overrides: Mapping | None = None) -> GenerationDefaults:
    """The defaults in force for `model` as the user named it (cheap: reads metadata only)."""
    if mode == "vinoserve":
        defaults = GenerationDefaults()
    elif mode == "auto":
        defaults = _builtin(model) if model is None or model in default_model.BUILTIN_MODELS else _from_file(
            Path(model).expanduser())
    else:
        path = Path(mode).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ModelLoadError(f"--generation-config {mode!r}: expected auto, vinoserve, or a directory "
                                 f"holding generation_config.json")
        defaults = _read(path)
    if overrides:
        defaults = defaults.overridden(GenerationDefaults.from_generation_config(
            overrides, "--override-generation-config"))
    return defaults


def _from_file(path: Path) -> GenerationDefaults:
    if path.is_dir():
        return _read(path / "generation_config.json")
    if path.is_file():
        return _from_gguf(path)
    return GenerationDefaults()  # the loader reports a missing model


def _from_gguf(path: Path) -> GenerationDefaults:
    """llama.cpp's general.sampling.* keys, where the GGUF has them. (penalty_repeat is left out:
    llama.cpp applies it to the last N tokens only, not to the whole sequence as requests do.)"""
    fields = open_gguf(path).fields
    config = {name: fields[key].contents() for key, name in _GGUF_KEYS.items() if key in fields}
    return GenerationDefaults.from_generation_config(config, f"{path.name} metadata")


def _builtin(model: str | None) -> GenerationDefaults:
    builtin = default_model.BUILTIN_MODELS.get(model or default_model.DEFAULT_MODEL.name)
    if builtin is None or not builtin.generation:
        return GenerationDefaults()
    return GenerationDefaults.from_generation_config(builtin.generation, f"{builtin.name} recommended")


def _read(path: Path) -> GenerationDefaults:
    if not path.is_file():
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return GenerationDefaults.from_generation_config(config, str(path))
