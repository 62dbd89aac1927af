"""The paged KV cache: key and value buffers allocated once, written in place by the kernel."""
from __future__ import annotations

from collections.abc import Sequence

import openvino as ov

from vinoserve.model.paged import CacheLayout


def num_blocks_for_bytes(budget_bytes: int, layout: CacheLayout, num_buffers: int) -> int:
    return budget_bytes // (layout.bytes_per_block() * num_buffers)


class KVCache:
    """A key and a value buffer per slot; `keys[layer]` is the buffer that layer reads and writes.
    Without layer groups every layer has a slot of its own; with them (layer_groups.py) layers of
    different groups share a buffer, each in the blocks its group's table names."""

    def __init__(self, layout: CacheLayout, num_layers: int, num_blocks: int,
                 slot_of: Sequence[int] | None = None) -> None:
        slot_of = list(range(num_layers)) if slot_of is None else list(slot_of)
        self.layout = layout
        self.num_blocks = num_blocks
        num_slots = max(slot_of) + 1
        key_slots = [ov.Tensor(layout.key_type, [num_blocks, *layout.key_block_shape]) for _ in range(num_slots)]
        value_slots = [ov.Tensor(layout.value_type, [num_blocks, *layout.value_block_shape]) for _ in range(num_slots)]
        self._buffers = key_slots + value_slots
        self.keys = [key_slots[s] for s in slot_of]
        self.values = [value_slots[s] for s in slot_of]

    def zero_block(self, block: int) -> None:
        """Every buffer's keys and values of `block` (quantization parameters included) to 0."""
        for tensor in self._buffers:
            tensor.data.reshape(self.num_blocks, -1)[block] = 0

    @property
    def nbytes(self) -> int:
        return sum(t.byte_size for t in self._buffers)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every buffer, keys and values, quantization parameters
        included: a forked sequence's own copy of a partly filled shared block."""
        for tensor in self._buffers:
            # Flat per block, so packed types (u4: one byte per two elements) copy too.
            data = tensor.data.reshape(self.num_blocks, -1)
            for src, dst in copies:
                data[dst] = data[src]
