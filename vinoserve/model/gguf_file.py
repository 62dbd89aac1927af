"""A GGUF file as it is stored: opened, its metadata fields, its tensors as the file holds them.

The types here are what architectures (model/architectures/) and weight formats (weights.py) read;
they depend on neither, so the loader that picks an architecture (gguf_loader.py) sits above all three.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model.errors import ModelLoadError


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass(frozen=True)
class GGUFTensor:
    """A weight as the file holds it. Quantized types keep their blocks: `data` is uint8
    [rows, bytes per row]; float types are [rows, cols] (1-D tensors: [n]). Rows are in HF's
    order, so taking rows and dequantizing commute."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]  # HF layout: [out, in] for matrices
    path: Path | None = None  # for error messages

    @classmethod
    def from_array(cls, name: str, a: np.ndarray) -> GGUFTensor:
        a = np.ascontiguousarray(a, dtype=np.float32)
        return cls(name, gguf.GGMLQuantizationType.F32, a, a.shape)

    def dequantize(self) -> np.ndarray:
        """float32 values in `shape`."""
        try:
            w = gguf.quants.dequantize(self.data, self.ggml_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {self.name} is {self.ggml_type.name}, which vinoserve cannot "
                                 f"read; supported: {', '.join(readable_types())}") from e
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: cannot dequantize {self.name} ({self.ggml_type.name}): {e}") from e
        return w.reshape(self.shape)

    def rows(self, start: int, stop: int, name: str | None = None) -> GGUFTensor:
        """Rows [start, stop) of a matrix (a part of a fused one): rows are whole quant blocks,
        so this is exact for every type."""
        if not 0 <= start < stop <= self.shape[0]:
            raise ModelLoadError(f"{self.path}: {self.name} has {self.shape[0]} rows, not [{start}, {stop})")
        return replace(self, name=name or f"{self.name}[{start}:{stop}]", data=self.data[start:stop],
                       shape=(stop - start, *self.shape[1:]))

    def with_rows(self, data: np.ndarray) -> GGUFTensor:
        """The same tensor with its rows (whole blocks) rearranged."""
        return replace(self, data=np.ascontiguousarray(data))


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The tensor types gguf-py dequantizes, found by asking it for one block of each."""
    names = []
    for t in gguf.GGMLQuantizationType:
        _, size = gguf.GGML_QUANT_SIZES[t]
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), t)
        except (NotImplementedError, ValueError):
            continue
        names.append(t.name)
    return tuple(names)


@dataclass
class GGUFMeta:
    """A GGUF file's metadata and tensor index, as the architectures read them."""

    path: Path
    reader: gguf.GGUFReader
    tensors: dict[str, gguf.ReaderTensor]
    architecture: str

    def field(self, key: str, default=None):
        return field(self.reader, key, default)

    def key(self, name: str, default=None):
        """`{architecture}.{name}`: the keys llama.cpp's converter writes per architecture."""
        return field(self.reader, f"{self.architecture}.{name}", default)

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        """Tensor `name` exactly as stored (rows in the file's order)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data.reshape(-1)
        return GGUFTensor(name, t.tensor_type, data, shape, self.path)
