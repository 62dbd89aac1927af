"""Block tables over the allocators: grow as a sequence grows, shrink by eviction, freed whole.

Without eviction every layer uses the same logical-to-physical table, so one table and one
allocator serve all layers. With eviction each layer drops different blocks, so there is a table
and an allocator per layer; all layers still hold the same NUMBER of blocks at any time, so the
free counts stay equal and capacity checks look at one of them.

Prefix caching (a `salt` given) needs one table for all layers: with eviction, blocks are dropped
and keys rotated in place per layer, so their content no longer matches a token prefix.
"""
from __future__ import annotations

from vinoserve.cache.block_allocator import BlockAllocator
from vinoserve.cache.prefix_cache import PrefixCache

BlockTables = list[list[int]]  # one table per group (1, or one per layer)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1, prefix_salt: bytes | None = None) -> None:
        self.allocators = [BlockAllocator(num_blocks) for _ in range(num_groups)]
        self.block_size = block_size
        if prefix_salt is not None and num_groups != 1:
            raise ValueError("prefix caching needs one block table for all layers (no cache eviction)")
        self.prefix = PrefixCache(self.allocators[0], block_size, prefix_salt) if prefix_salt is not None else None

    @property
    def num_groups(self) -> int:
        return len(self.allocators)

    @property
    def num_free_blocks(self) -> int:
        return self.allocators[0].num_free

    @property
    def num_blocks(self) -> int:
        return self.allocators[0].num_blocks

    def new_tables(self) -> BlockTables:
        return [[] for _ in self.allocators]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, tables: BlockTables, num_tokens: int) -> int:
        """Blocks each table must add to hold `num_tokens` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(tables[0]))

    def can_grow(self, tables: BlockTables, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(tables, num_tokens) + reserve <= self.num_free_blocks

    def grow(self, tables: BlockTables, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(tables, num_tokens)):
            for table, allocator in zip(tables, self.allocators):
                table.append(allocator.allocate())

    def trim(self, tables: BlockTables, num_tokens: int) -> None:
        """Free the blocks past those holding `num_tokens` tokens (rejected speculative tokens')."""
        keep = self.blocks_for(num_tokens)
        for table, allocator in zip(tables, self.allocators):
            while len(table) > keep:
                allocator.free(table.pop())

    def adopt(self, tables: BlockTables, cached: list[int]) -> None:
        """Start an empty table with cached prefix blocks (shared, never written)."""
        allocator = self.allocators[0]
        tables[0].extend(allocator.share(b) for b in cached)

    def num_reviving(self, cached: list[int]) -> int:
        """Of these cached blocks, those that are free now: adopting them takes free blocks."""
        return sum(self.allocators[0].is_free(b) for b in cached)

    def fork(self, tables: BlockTables) -> BlockTables:
        """A second owner of every block (choices sharing their prompt). Forks need one table for
        all layers: with eviction, blocks are evicted and rotated in place per sequence."""
        if self.num_groups != 1:
            raise ValueError("sequences cannot share blocks while cache eviction is on")
        return [[self.allocators[0].share(b) for b in tables[0]]]

    def copies_needed(self, tables: BlockTables, start: int) -> int:
        """1 if writing from token `start` on would write into a shared, partly filled block."""
        i, offset = divmod(start, self.block_size)
        return int(offset != 0 and i < len(tables[0]) and self.allocators[0].ref_count(tables[0][i]) > 1)

    def own_block_at(self, tables: BlockTables, start: int) -> tuple[int, int] | None:
        """Give this owner its own block in place of the shared one token `start` is written into;
        returns (src, dst): the caller copies the KV before anything writes to dst."""
        if not self.copies_needed(tables, start):
            return None
        i, allocator = start // self.block_size, self.allocators[0]
        src, dst = tables[0][i], allocator.allocate()
        allocator.free(src)
        tables[0][i] = dst
        return src, dst

    def drop(self, group: int, table: list[int], logical: list[int]) -> None:
        """Evict the blocks at these logical indices of one group's table."""
        gone = set(logical)
        for i in sorted(gone, reverse=True):
            self.allocators[group].free(table.pop(i))

    def free(self, tables: BlockTables) -> None:
        for table, allocator in zip(tables, self.allocators):
            for block in reversed(table):
                allocator.free(block)
            table.clear()
