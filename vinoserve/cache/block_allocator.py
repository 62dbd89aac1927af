"""Fixed-size KV-cache blocks: a free list and reference counts, O(1) allocate and free.

Free blocks that still hold a cached prefix (see prefix_cache.py) wait in a least-recently-freed
queue and are handed out only when no plain free block is left, so cached prefixes live as long
as memory allows."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._refs = [0] * num_blocks
        self.cached: set[int] = set()  # blocks whose content a prefix cache may hand out again
        self.on_reuse: Callable[[int], None] | None = None  # told when a cached block is overwritten

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            self.cached.discard(block)
            if self.on_reuse is not None:
                self.on_reuse(block)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        self._refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """Another owner (a fork or a prefix hit) holds `block` too; revives a free cached block."""
        if self._refs[block] == 0:
            if block not in self._cached_free:
                raise ValueError(f"block {block} is not allocated")
            del self._cached_free[block]
        self._refs[block] += 1
        return block

    def free(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self.cached:
                self._cached_free[block] = None
            else:
                self._free.append(block)

    def uncache(self, block: int) -> None:
        """The block's content is no longer a cached prefix; if free, it becomes a plain free block."""
        self.cached.discard(block)
        if block in self._cached_free:
            del self._cached_free[block]
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0
