"""Graph constants backed by a scratch file, so converting a model never holds all its weights in memory.

`ov.save_model` needs the whole graph, constants included. Built from numpy arrays, an 8B model's
constants would all sit in anonymous memory at once (beside the GGUF's own mapped pages). Here
each constant is written to a scratch file as soon as it is made and the graph gets a read-only
memory map of it: clean file pages the kernel can drop and re-read, so the converter's footprint
stays near one tensor's temporaries. The store must outlive the graph's last use (saving).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

_ALIGN = 64


class ConstantStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("wb")
        self._offset = 0
        self._maps: list[np.memmap] = []  # the graph's constants point into these

    def constant(self, data: np.ndarray, element: ov.Type | None = None, name: str | None = None) -> ov.Node:
        """A Constant holding `data` (for a packed 4-bit `element`, its bytes), mapped from the file."""
        data = np.ascontiguousarray(data)
        self._file.write(b"\0" * (-self._offset % _ALIGN))
        self._offset += -self._offset % _ALIGN
        self._file.write(data.tobytes())  # one tensor's copy at a time
        self._file.flush()
        mapped = np.memmap(self.path, dtype=data.dtype, mode="c", offset=self._offset, shape=data.shape)
        self._offset += data.nbytes
        self._maps.append(mapped)
        return _constant(mapped, element, name, shared=True)

    def close(self) -> None:
        self._maps.clear()
        self._file.close()
        self.path.unlink(missing_ok=True)


def _constant(data: np.ndarray, element: ov.Type | None, name: str | None, shared: bool) -> ov.Node:
    if element is not None and element.bitwidth == 4:  # `data` holds packed bytes
        shape = ov.Shape([*data.shape[:-1], data.shape[-1] * 2])
        if shared:  # the Tensor views the caller's bytes, the Constant shares the Tensor's memory
            t = ov.Tensor(data, shape, element)
        else:
            t = ov.Tensor(element, shape)
            np.copyto(t.data.reshape(data.shape), data)
        c = ops.constant(t)
    else:
        c = ops.constant(data, shared_memory=shared)
    if name:
        c.set_friendly_name(name)
    return c


def in_memory_constant(data: np.ndarray, element: ov.Type | None = None, name: str | None = None) -> ov.Node:
    """A Constant owning a copy of `data`, for graphs built and compiled in memory (as tests do)."""
    return _constant(data, element, name, shared=False)
