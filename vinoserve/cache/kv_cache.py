"""The paged KV cache: per-layer key and value tensors allocated once, written in place by the kernel."""
from __future__ import annotations

import openvino as ov

from vinoserve.model.paged import CacheLayout


def num_blocks_for_bytes(budget_bytes: int, layout: CacheLayout, num_layers: int) -> int:
    return budget_bytes // (layout.bytes_per_block() * num_layers)


class KVCache:
    def __init__(self, layout: CacheLayout, num_layers: int, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.keys = [ov.Tensor(layout.key_type, [num_blocks, *layout.key_block_shape]) for _ in range(num_layers)]
        self.values = [ov.Tensor(layout.value_type, [num_blocks, *layout.value_block_shape]) for _ in range(num_layers)]

    def zero_block(self, block: int) -> None:
        """Every layer's keys and values of `block` (quantization parameters included) to 0."""
        for tensor in self.keys + self.values:
            tensor.data.reshape(self.num_blocks, -1)[block] = 0

    @property
    def nbytes(self) -> int:
        return sum(t.byte_size for t in self.keys + self.values)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every layer, keys and values, quantization parameters
        included: a forked sequence's own copy of a partly filled shared block."""
        for tensor in self.keys + self.values:
            # Flat per block, so packed types (u4: one byte per two elements) copy too.
            data = tensor.data.reshape(self.num_blocks, -1)
            for src, dst in copies:
                data[dst] = data[src]
