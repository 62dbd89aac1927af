"""Layer groups (a block table per group of sliding or global layers, one pool) and prefix-cache
hits across them: global groups need the whole prefix cached, sliding groups only its window."""
from __future__ import annotations

from vinoserve.cache.block_manager import BlockManager
from vinoserve.cache.layer_groups import LayerGroups

B = 4


def test_gemma3_1b_layers_fall_into_one_global_group_and_six_sliding_groups_of_four():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))  # 4 global, 22 sliding
    g = LayerGroups.of(windows, 26)
    assert g.windows == (0,) + (512,) * 6 and g.num_slots == 4 and g.hybrid
    assert [g.table_of[i] for i in (5, 11, 17, 23)] == [0] * 4 and [g.slot_of[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    # each (table, slot) pair is one layer's: no two layers write the same blocks of the same buffer
    assert len({(g.table_of[i], g.slot_of[i]) for i in range(26)}) == 26
    assert LayerGroups.of((), 30) == LayerGroups((0,), (0,) * 30, tuple(range(30)))
    assert LayerGroups.of((40,) * 4, 4).windows == (40,) and not LayerGroups.of((40,) * 4, 4).hybrid


def _computed(blocks: BlockManager, tokens: list[int]) -> list[list[int]]:
    """Tables of a sequence whose tokens were all computed and registered, then freed."""
    tables, hashes = blocks.new_tables(), []
    get = lambda a, b: tokens[a:b]  # noqa: E731
    blocks.grow(tables, len(tokens))
    blocks.prefix.extend_hashes(hashes, get, len(tokens) // B)
    for i in range(len(tokens) // B):
        blocks.register(tables, i, hashes, get)
    return tables


def test_a_hit_takes_the_global_groups_whole_prefix_and_the_sliding_groups_window():
    blocks = BlockManager(64, B, prefix_salt=b"s", group_windows=(0, 6))
    tokens = list(range(100, 124))  # six blocks
    get = lambda a, b: tokens[a:b]  # noqa: E731
    tables = _computed(blocks, tokens)
    assert blocks.num_free_blocks == 63 - 2 * 6
    blocks.release_behind(tables, 24)  # the sliding group keeps only what query 24 sees: blocks 4, 5
    assert tables[1][:4] == [blocks.null_block] * 4 and blocks.null_block not in tables[0]
    # The released sliding blocks stay cached until the pool needs them: take them all.
    taken = [blocks.allocators[0].allocate() for _ in range(blocks.num_free_blocks)]
    assert blocks.num_free_blocks == 0
    # A 25-token sequence can start at token 24: its first query sees keys 19..23, sliding blocks 4 and 5.
    hits = blocks.match_prefix([], get, 25)
    assert [h[0] for h in hits] == tables[0] and [h[1] for h in hits] == [None] * 4 + tables[1][4:]
    adopted = blocks.new_tables()
    blocks.adopt(adopted, hits, 24)
    assert adopted[0] == tables[0] and adopted[1] == tables[1]
    # A 21-token one would start at token 20, which sees sliding block 3: gone, and so on down.
    assert blocks.match_prefix([], get, 21) == []
    for table in (adopted, tables):
        blocks.free(table)
    for b in taken:
        blocks.allocators[0].free(b)
    assert blocks.num_free_blocks == 63
