"""Automatic prefix caching: full KV blocks keyed by a hash chained over every token before them.

A block is registered once the step that computes it is launched: steps run one after another, so
any step that reads a hit runs after its KV is written. A
hit checks the block's own tokens and its parent's hash, so a hash collision costs a miss, never
a wrong answer. Cached blocks of finished sequences stay in the allocator's least-recently-freed
queue and are overwritten only when no plain free block is left; the allocator tells us then.
Where layer groups have tables of their own (block_manager.py), a prefix block is one physical
block per group, each cached (and overwritten) on its own.
A block whose positions take image rows in place of token embeddings (scheduler/media.py) has
the images' keys in its hash and its hit check (`extra`): the same placeholder tokens with
another image are another block. The blocks after it chain from it through the parent hash.
The first block's parent is a salt over everything that changes the KV besides the tokens
(model, cache layout and precision), so a cache can never be read under other settings.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vinoserve.cache.block_allocator import BlockAllocator

TokenRange = Callable[[int, int], Sequence[int]]  # tokens [start, stop) of one sequence
ExtraKeys = Callable[[int, int], bytes]  # what else fixes the KV of [start, stop): b"" for nothing


def no_extra_keys(start: int, stop: int) -> bytes:
    return b""


def salt_hash(*parts: object) -> bytes:
    """The chain's root, from whatever identifies the model and the cache's numerics."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def chain_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes() + extra, digest_size=16).digest()


@dataclass(frozen=True)
class _Entry:
    parent: bytes
    hash: bytes
    tokens: tuple[int, ...]
    group: int
    extra: bytes = b""


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, salt: bytes, num_groups: int = 1) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.salt = salt
        self.num_groups = num_groups
        self._by_hash: dict[bytes, list[int | None]] = {}  # a block per group, None where not cached
        self._entries: dict[int, _Entry] = {}
        allocator.on_reuse = self._forget
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def extend_hashes(self, hashes: list[bytes], tokens: TokenRange, num_blocks: int,
                      extra: ExtraKeys = no_extra_keys) -> list[bytes]:
        """Grow a sequence's chain (`hashes`, kept by the caller) to its first `num_blocks` blocks."""
        b = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(chain_hash(hashes[i - 1] if i else self.salt, tokens(i * b, (i + 1) * b),
                                     extra(i * b, (i + 1) * b)))
        return hashes

    def match(self, hashes: list[bytes], tokens: TokenRange, num_tokens: int,
              required: Sequence[int] = (0,), extra: ExtraKeys = no_extra_keys) -> list[tuple[int | None, ...]]:
        """Cached blocks (one per group) of the longest prefix of a sequence of `num_tokens`
        tokens whose blocks are cached in every `required` group. The last token is never
        covered, so it is computed and its logits exist."""
        b = self.block_size
        self.extend_hashes(hashes, tokens, (num_tokens - 1) // b, extra)
        hits: list[tuple[int | None, ...]] = []
        for i in range((num_tokens - 1) // b):
            blocks = self._by_hash.get(hashes[i])
            if blocks is None or any(blocks[g] is None for g in required):
                break
            entry = self._entries[next(x for x in blocks if x is not None)]
            if (entry.parent != (hashes[i - 1] if i else self.salt) or entry.tokens != tuple(tokens(i * b, (i + 1) * b))
                    or entry.extra != extra(i * b, (i + 1) * b)):
                break
            hits.append(tuple(blocks))
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def register(self, blocks: int | Sequence[int | None], index: int, hashes: list[bytes], tokens: TokenRange,
                 extra: ExtraKeys = no_extra_keys) -> None:
        """`blocks` (one per group, None where released) now hold the computed KV of the
        sequence's block `index` (hashes extended)."""
        if isinstance(blocks, int):
            blocks = (blocks,)
        h = hashes[index]
        cached = self._by_hash.setdefault(h, [None] * self.num_groups)
        b = self.block_size
        for group, block in enumerate(blocks):
            # Another block holding this prefix already (computed side by side) stays.
            if block is None or cached[group] is not None or block in self._entries:
                continue
            cached[group] = block
            self._entries[block] = _Entry(hashes[index - 1] if index else self.salt, h,
                                          tuple(tokens(index * b, (index + 1) * b)), group,
                                          extra(index * b, (index + 1) * b))
            self.allocator.cached.add(block)
        if all(x is None for x in cached):
            del self._by_hash[h]

    def is_cached(self, h: bytes) -> bool:
        return h in self._by_hash

    def entry_tokens(self, block: int) -> tuple[int, ...] | None:
        e = self._entries.get(block)
        return None if e is None else e.tokens

    def entry_hash(self, block: int) -> bytes | None:
        e = self._entries.get(block)
        return None if e is None else e.hash

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block)
        cached = self._by_hash[entry.hash]
        cached[entry.group] = None
        if all(x is None for x in cached):
            del self._by_hash[entry.hash]
