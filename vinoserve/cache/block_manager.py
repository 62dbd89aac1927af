"""Block tables over the allocators: grow as a sequence grows, shrink by eviction, freed whole.

Without eviction every layer uses the same logical-to-physical table, so one table and one
allocator serve all layers. With eviction each layer drops different blocks, so there is a table
and an allocator per layer; all layers still hold the same NUMBER of blocks at any time, so the
free counts stay equal and capacity checks look at one of them.

Prefix caching (a `salt` given) needs one table for all layers: with eviction, blocks are dropped
and keys rotated in place per layer, so their content no longer matches a token prefix.

Where every layer attends to at most `window` tokens back, a sequence's blocks that fall behind
the window of its next query are freed as it moves on (release_behind): their table entries then
name `null_block`, a block no one owns, zeroed by the cache. The kernel may still read an entry
behind the window (the CPU plugin does at f32) but masks it, and a finite block masked is
exactly nothing; a freed block that was never zeroed could hold a NaN.
"""
from __future__ import annotations

from vinoserve.cache.block_allocator import BlockAllocator
from vinoserve.cache.prefix_cache import PrefixCache

BlockTables = list[list[int]]  # one table per group (1, or one per layer)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1, prefix_salt: bytes | None = None,
                 window: int = 0) -> None:
        if window and num_groups != 1:
            raise ValueError("windowed blocks are released from one block table for all layers (no cache eviction)")
        self.window = window
        # The last block is the null block where there is a window: the allocators never hand it out.
        self.null_block = num_blocks - 1 if window else None
        self.allocators = [BlockAllocator(num_blocks - bool(window)) for _ in range(num_groups)]
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

    def behind(self, first_query: int) -> int:
        """How many leading blocks no query from `first_query` on sees (keys before
        first_query - window + 1); 0 without a window."""
        return max(0, first_query - self.window + 1) // self.block_size if self.window else 0

    def most_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` holds at most at once, steps of up to
        `max_step_tokens` new tokens: all of them, or with a window the blocks one step spans."""
        whole = self.blocks_for(num_tokens)
        return min(whole, -(-(self.window - 1 + max_step_tokens) // self.block_size) + 1) if self.window else whole

    def release_behind(self, tables: BlockTables, first_query: int) -> None:
        """Free the blocks behind the window of the next query. Released entries form a prefix
        of the table, so this walks back only over the blocks it frees."""
        table, allocator = tables[0], self.allocators[0]
        i = min(self.behind(first_query), len(table)) - 1
        while i >= 0 and table[i] != self.null_block:
            allocator.free(table[i])
            table[i] = self.null_block
            i -= 1

    def adopt(self, tables: BlockTables, cached: list[int], first_query: int) -> None:
        """Start an empty table with cached prefix blocks (shared, never written); those behind
        the window of `first_query` are not taken."""
        skip = min(self.behind(first_query), len(cached))
        tables[0].extend([self.null_block] * skip + [self.allocators[0].share(b) for b in cached[skip:]])

    def num_reviving(self, cached: list[int], first_query: int) -> int:
        """Of these cached blocks, those adopt() takes that are free now: they take free blocks."""
        return sum(self.allocators[0].is_free(b) for b in cached[self.behind(first_query):])

    def fork(self, tables: BlockTables) -> BlockTables:
        """A second owner of every block (choices sharing their prompt). Forks need one table for
        all layers: with eviction, blocks are evicted and rotated in place per sequence."""
        if self.num_groups != 1:
            raise ValueError("sequences cannot share blocks while cache eviction is on")
        return [[b if b == self.null_block else self.allocators[0].share(b) for b in tables[0]]]

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
                if block != self.null_block:
                    allocator.free(block)
            table.clear()
