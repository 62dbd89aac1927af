"""Open a GGUF file for conversion: its architecture, config and tensors in HF's order.

What the file may be, how its metadata becomes a ModelConfig and which tensors its family stores
differently from HF (permuted rows, fused matrices) is each architecture's business
(model/architectures/); reading the file itself is gguf_file.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model import architectures
from vinoserve.model.config import ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta, GGUFTensor, field, open_gguf


@dataclass
class GGUFModel:
    """A GGUF file opened for conversion: its architecture's config and weights on demand."""

    path: Path
    reader: gguf.GGUFReader
    meta: GGUFMeta
    family: type[architectures.Decoder]
    config: ModelConfig

    @classmethod
    def open(cls, path: Path) -> GGUFModel:
        reader = open_gguf(path)
        arch = field(reader, "general.architecture")
        family = architectures.for_gguf(arch)  # ModelLoadError naming what is supported
        meta = GGUFMeta(path, reader, {t.name: t for t in reader.tensors}, arch)
        try:
            config = family.config_from_gguf(meta)
        except ValueError as e:  # a value ModelConfig or RopeConfig refuses (say, an unknown RoPE scaling)
            raise ModelLoadError(f"{path}: {e}") from e
        return cls(path, reader, meta, family, config)

    def tensor(self, name: str) -> GGUFTensor:
        """Tensor `name` as the file holds it, rows in HF order ([out, in] for matrices)."""
        return self.family.from_file(self.meta.tensor(name), self.config)

    def weight(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in HF layout ([out, in] for matrices)."""
        return self.tensor(name).dequantize()

    def has(self, name: str) -> bool:
        return self.meta.has(name)
