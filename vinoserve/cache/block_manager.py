"""Block tables over the allocators: grow as a sequence grows, shrink by eviction, freed whole.

Without eviction every layer uses the same logical-to-physical table, so one table and one
allocator serve all layers. With eviction each layer drops different blocks, so there is a table
and an allocator per layer; all layers still hold the same NUMBER of blocks at any time, so the
free counts stay equal and capacity checks look at one of them.

Where layers attend over different spans (Gemma 3's sliding and global layers, see
layer_groups.py), each layer group has its own table (`group_windows`), all drawing on ONE pool:
a step that grows a sequence by k blocks takes k from the pool for every group.

Prefix caching (a `salt` given) needs tables that a token prefix determines: not with eviction,
where blocks are dropped and keys rotated in place per layer.

Where a group's layers attend to at most `window` tokens back, a sequence's blocks that fall behind
the window of its next query are freed from that group's table as it moves on (release_behind):
their table entries then name `null_block`, a block no one owns, zeroed by the cache. All tables
of a sequence keep the same length, so the kernel's past_lens and block_indices_begins are
shared. The kernel may still read an entry behind the window (the CPU plugin does at f32) but
masks it, and a finite block masked is exactly nothing; a freed block never zeroed could hold a NaN.
"""
from __future__ import annotations

from collections.abc import Sequence

from vinoserve.cache.block_allocator import BlockAllocator
from vinoserve.cache.prefix_cache import ExtraKeys, PrefixCache, TokenRange, no_extra_keys

BlockTables = list[list[int]]  # one table per group (1, one per layer group, or one per layer)
Hit = tuple[int | None, ...]  # a cached block's physical block in each group (None: not cached there)


def blocks_held(windows: Sequence[int], block_size: int, num_tokens: int, max_step_tokens: int) -> int:
    """Blocks tables of these windows (0: none) draw from their pool at most at once for a
    sequence of `num_tokens`, steps of up to `max_step_tokens` new tokens: all of them, or with a
    window the blocks one step spans."""
    whole = -(-num_tokens // block_size)
    return sum(min(whole, -(-(w - 1 + max_step_tokens) // block_size) + 1) if w else whole for w in windows)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1, prefix_salt: bytes | None = None,
                 window: int = 0, group_windows: Sequence[int] = ()) -> None:
        shared = bool(group_windows)
        if shared:
            self.windows = list(group_windows)
        elif window and num_groups != 1:
            raise ValueError("windowed blocks are released from one block table for all layers (no cache eviction)")
        else:
            self.windows = [window] * num_groups
        if prefix_salt is not None and not shared and num_groups != 1:
            raise ValueError("prefix caching needs one block table for all layers (no cache eviction)")
        self.releases = any(self.windows)
        # The last block is the null block where there is a window: the allocators never hand it out.
        self.null_block = num_blocks - 1 if self.releases else None
        usable = num_blocks - self.releases
        pool = BlockAllocator(usable) if shared else None
        self.allocators = [pool or BlockAllocator(usable) for _ in self.windows]
        self._per_pool = len(self.windows) if shared else 1  # tables that draw on one allocator
        # A block can have several owners (forks, prefix hits) unless each layer evicts its own.
        self._sharing = self._per_pool == len(self.windows)
        self.block_size = block_size
        self.prefix = PrefixCache(self.allocators[0], block_size, prefix_salt, len(self.windows)) \
            if prefix_salt is not None else None

    @property
    def window(self) -> int:
        """The window of a single table (0: none, or several tables)."""
        return self.windows[0] if len(self.windows) == 1 else 0

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
        """Blocks the pool must give for the tables to hold `num_tokens` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(tables[0])) * self._per_pool

    def can_grow(self, tables: BlockTables, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(tables, num_tokens) + reserve <= self.num_free_blocks

    def grow(self, tables: BlockTables, num_tokens: int) -> None:
        for _ in range(max(0, self.blocks_for(num_tokens) - len(tables[0]))):
            for table, allocator in zip(tables, self.allocators):
                table.append(allocator.allocate())

    def trim(self, tables: BlockTables, num_tokens: int) -> None:
        """Free the blocks past those holding `num_tokens` tokens (rejected speculative tokens')."""
        keep = self.blocks_for(num_tokens)
        for table, allocator in zip(tables, self.allocators):
            while len(table) > keep:
                allocator.free(table.pop())

    def behind(self, first_query: int, group: int = 0) -> int:
        """How many leading blocks of a group no query from `first_query` on sees (keys before
        first_query - window + 1); 0 without a window."""
        window = self.windows[group]
        return max(0, first_query - window + 1) // self.block_size if window else 0

    def most_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` takes from a pool at most at once (see blocks_held)."""
        return blocks_held(self.windows[:self._per_pool], self.block_size, num_tokens, max_step_tokens)

    def release_behind(self, tables: BlockTables, first_query: int) -> None:
        """Free the blocks behind the window of the next query. Released entries form a prefix
        of a table, so this walks back only over the blocks it frees."""
        for group, (table, allocator) in enumerate(zip(tables, self.allocators)):
            i = min(self.behind(first_query, group), len(table)) - 1
            while i >= 0 and table[i] != self.null_block:
                allocator.free(table[i])
                table[i] = self.null_block
                i -= 1

    # ---- prefix caching
    def match_prefix(self, hashes: list[bytes], tokens: TokenRange, num_tokens: int,
                     extra: ExtraKeys = no_extra_keys) -> list[Hit]:
        """Cached blocks a sequence of `num_tokens` tokens can start from: every group's blocks
        of the prefix, except a windowed group's behind the window of the first token computed."""
        whole = [g for g, w in enumerate(self.windows) if not w]
        hits = self.prefix.match(hashes, tokens, num_tokens, whole, extra)
        n = len(hits)
        while n and any(hits[i][g] is None for g, w in enumerate(self.windows) if w
                        for i in range(self.behind(n * self.block_size, g), n)):
            n -= 1
        return hits[:n]

    def adopt(self, tables: BlockTables, hits: list[Hit], first_query: int) -> None:
        """Start empty tables with cached prefix blocks (shared, never written); those behind
        the window of `first_query` are not taken."""
        for group, (table, allocator) in enumerate(zip(tables, self.allocators)):
            skip = min(self.behind(first_query, group), len(hits))
            table.extend([self.null_block] * skip + [allocator.share(h[group]) for h in hits[skip:]])

    def admission_cost(self, hits: list[Hit], num_tokens: int) -> int:
        """Free blocks that adopting `hits` and growing to `num_tokens` tokens takes: new
        blocks, and the cached ones adopted while free."""
        first_query = len(hits) * self.block_size
        reviving = sum(allocator.is_free(h[group])
                       for group, allocator in enumerate(self.allocators)
                       for h in hits[self.behind(first_query, group):])
        return (self.blocks_for(num_tokens) - len(hits)) * self._per_pool + reviving

    def register(self, tables: BlockTables, index: int, hashes: list[bytes], tokens: TokenRange,
                 extra: ExtraKeys = no_extra_keys) -> None:
        """Block `index` of these tables now holds computed KV: cache it where not released."""
        blocks = tuple(None if t[index] == self.null_block else t[index] for t in tables)
        if any(b is not None for b in blocks):
            self.prefix.register(blocks, index, hashes, tokens, extra)

    def fork(self, tables: BlockTables) -> BlockTables:
        """A second owner of every block (choices sharing their prompt). Not with eviction,
        where blocks are evicted and rotated in place per sequence."""
        if not self._sharing:
            raise ValueError("sequences cannot share blocks while cache eviction is on")
        return [[b if b == self.null_block else allocator.share(b) for b in table]
                for table, allocator in zip(tables, self.allocators)]

    def copies_needed(self, tables: BlockTables, start: int) -> int:
        """Blocks to copy if writing from token `start` on would write into shared, partly filled blocks."""
        i, offset = divmod(start, self.block_size)
        if offset == 0 or i >= len(tables[0]) or not self._sharing:
            return 0
        return sum(allocator.ref_count(t[i]) > 1 for t, allocator in zip(tables, self.allocators))

    def own_blocks_at(self, tables: BlockTables, start: int) -> list[tuple[int, int]]:
        """Give this owner its own blocks in place of the shared ones token `start` is written
        into; returns (src, dst) pairs: the caller copies the KV before anything writes to dst."""
        if not self.copies_needed(tables, start):
            return []
        i, copies = start // self.block_size, []
        for table, allocator in zip(tables, self.allocators):
            if allocator.ref_count(table[i]) > 1:
                src, dst = table[i], allocator.allocate()
                allocator.free(src)
                table[i] = dst
                copies.append((src, dst))
        return copies

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
