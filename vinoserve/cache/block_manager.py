"""Block tables over the shared allocator: grow as a sequence grows, freed whole."""
from __future__ import annotations

from vinoserve.cache.block_allocator import BlockAllocator


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        """Blocks `table` must add to hold `num_tokens` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(table, num_tokens) + reserve <= self.allocator.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        for _ in range(self.blocks_needed(table, num_tokens)):
            table.append(self.allocator.allocate())

    def free(self, table: list[int]) -> None:
        for block in reversed(table):
            self.allocator.free(block)
        table.clear()
