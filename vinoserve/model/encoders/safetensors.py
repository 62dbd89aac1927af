"""Tensors of a safetensors file as numpy arrays, memory-mapped. The format is an 8-byte header
length, a JSON header and raw little-endian data; read here rather than through the safetensors
package because its numpy API cannot return bf16 (BGE and E5 checkpoints ship some in bf16)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from vinoserve.model.errors import ModelLoadError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32}


class SafeTensors:
    """The tensors of one or more .safetensors files (a sharded checkpoint), by name, as float32."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[np.memmap, dict]] = {}
        for file in files:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            data = np.memmap(file, np.uint8, "r", offset=8 + size)
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = (data, info)

    @classmethod
    def of_dir(cls, path: Path) -> SafeTensors:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has no .safetensors weights (pytorch_model.bin is not read: it needs torch)")
        return cls(files)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        data, info = self._where[name]
        if info["dtype"] not in _DTYPES:
            raise ModelLoadError(f"tensor {name}: dtype {info['dtype']} is not supported")
        begin, end = info["data_offsets"]
        raw = np.frombuffer(data[begin:end], _DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":  # bf16 is the top half of an f32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)
