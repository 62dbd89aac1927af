"""Which layers share a block table, and which cache buffer each layer reads and writes.

A model whose layers all see the same span (the whole context, or one sliding window) needs one
block table for all of them. Where some layers slide and others see everything (Gemma 3: five of
every six layers slide), the sliding layers need only the blocks inside their window while the
global layers need all of them, so their tables must differ. As vLLM's hybrid KV cache manager
does, layers of one attention span are cut into groups of equal size G (the smallest span's
layer count; the last group of a span padded), each group with its own block table, and there
are G cache buffers per key and value: layer i of every group lives in buffer i, so one pool of
block ids serves every group and a block freed by a sliding group can hold global layers' KV next.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int, ...]  # per group: its layers' window in tokens (0: the whole context)
    table_of: tuple[int, ...]  # per layer: its group, i.e. the block table it reads
    slot_of: tuple[int, ...]  # per layer: the cache buffer it reads and writes

    @classmethod
    def of(cls, sliding_windows: tuple[int, ...], num_layers: int) -> LayerGroups:
        """`sliding_windows` per layer (empty: none)."""
        windows = sliding_windows or (0,) * num_layers
        spans = Counter(windows)
        if len(spans) == 1:  # one table for all; a buffer per layer
            return cls((windows[0],), (0,) * num_layers, tuple(range(num_layers)))
        size = min(spans.values())
        group_windows, table_of, slot_of = [], [0] * num_layers, [0] * num_layers
        for window in sorted(spans):  # the whole context (0) first
            layers = [i for i, w in enumerate(windows) if w == window]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    table_of[layer], slot_of[layer] = len(group_windows), slot
                group_windows.append(window)
        return cls(tuple(group_windows), tuple(table_of), tuple(slot_of))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.slot_of) + 1

    @property
    def hybrid(self) -> bool:
        """Layers of different spans: a table per group over one shared pool."""
        return self.num_groups > 1
