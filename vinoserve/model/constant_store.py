"""Graph constants backed by a scratch file, so converting a model never holds all its weights in memory.

`ov.save_model` needs the whole graph, constants included. Built from numpy arrays, an 8B model's
constants would all sit in anonymous memory at once (beside the GGUF's own mapped pages). Here
each constant is written to a scratch file as soon as it is made and the graph gets a read-only
memory map of it: clean file pages the kernel can drop and re-read, so the converter's footprint
stays near one tensor's temporaries. Saving makes that file the IR's .bin, so the weights are
written to disk once. The store must outlive the graph's last use (saving).
"""
from __future__ import annotations

import os
from pathlib import Path
from xml.etree import ElementTree

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
        self._placed: dict[int, tuple[int, int]] = {}  # a Constant's instance id -> (offset, bytes)

    def constant(self, data: np.ndarray, element: ov.Type | None = None, name: str | None = None) -> ov.Node:
        """A Constant holding `data` (for a packed 4-bit `element`, its bytes), mapped from the file."""
        data = np.ascontiguousarray(data)
        offset = self._write(data)
        mapped = np.memmap(self.path, dtype=data.dtype, mode="c", offset=offset, shape=data.shape)
        self._maps.append(mapped)
        node = _constant(mapped, element, name, shared=True)
        self._placed[node.get_instance_id()] = (offset, data.nbytes)
        return node

    def save(self, model: ov.Model, xml: Path) -> None:
        """`model` as `xml` and the .bin beside it, which is this store's file renamed: the weights
        are written once, where ov.save_model would copy them all into a second file (a 30B
        model's conversion needed twice its size in free disk). The other constants are appended
        to it and each Const layer pointed at its bytes."""
        where = {}
        for node in _uniquely_named_constants(model):
            placed = self._placed.get(node.get_instance_id())
            if placed is None:
                raw = np.ascontiguousarray(node.get_tensor_view().data).view(np.uint8)
                placed = (self._write(raw), raw.nbytes)
            where[node.get_friendly_name()] = placed
        self._file.close()
        ov.serialize(model, str(xml), os.devnull)
        _point_constants(xml, where)
        self.path.rename(xml.with_suffix(".bin"))

    def close(self) -> None:
        self._maps.clear()
        self._file.close()
        self.path.unlink(missing_ok=True)

    def _write(self, data: np.ndarray) -> int:
        """Appends `data`'s bytes, aligned; returns their offset."""
        self._file.write(b"\0" * (-self._offset % _ALIGN))
        self._offset += -self._offset % _ALIGN
        offset = self._offset
        self._file.write(data.tobytes())  # one tensor's copy at a time
        self._file.flush()
        self._offset += data.nbytes
        return offset


def _uniquely_named_constants(model: ov.Model) -> list[ov.Node]:
    """The model's Constants, renamed where two share a name (the XML's layers are matched by it)."""
    constants, seen = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"], set()
    for node in constants:
        name = node.get_friendly_name()
        while name in seen:
            name += "_"
        node.set_friendly_name(name)
        seen.add(name)
    return constants


def _point_constants(xml: Path, where: dict[str, tuple[int, int]]) -> None:
    """Sets each Const layer's offset to its bytes' in the store's file (the serializer wrote none)."""
    tree = ElementTree.parse(xml)
    for layer in tree.getroot().iter("layer"):
        if layer.get("type") == "Const":
            data, (offset, size) = layer.find("data"), where[layer.get("name")]
            if int(data.get("size")) != size:
                raise ValueError(f"constant {layer.get('name')}: {data.get('size')} bytes in the XML, {size} stored")
            data.set("offset", str(offset))
    tree.write(xml, encoding="utf-8", xml_declaration=True)


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
