"""Fixed-size KV-cache blocks: a free list and reference counts, O(1) allocate and free."""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """Another owner (a fork or a prefix hit) holds `block` too."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1
        return block

    def free(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
