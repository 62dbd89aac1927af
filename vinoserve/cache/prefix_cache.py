"""Automatic prefix caching: full KV blocks keyed by a hash chained over every token before them.

A block is registered once the step that computes it is launched: steps run one after another, so
any step that reads a hit runs after its KV is written. A
hit checks the block's own tokens and its parent's hash, so a hash collision costs a miss, never
a wrong answer. Cached blocks of finished sequences stay in the allocator's least-recently-freed
queue and are overwritten only when no plain free block is left; the allocator tells us then.
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


def salt_hash(*parts: object) -> bytes:
    """The chain's root, from whatever identifies the model and the cache's numerics."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class _Entry:
    parent: bytes
    hash: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, salt: bytes) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.salt = salt
        self._by_hash: dict[bytes, int] = {}
        self._entries: dict[int, _Entry] = {}
        allocator.on_reuse = self._forget
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def extend_hashes(self, hashes: list[bytes], tokens: TokenRange, num_blocks: int) -> list[bytes]:
        """Grow a sequence's chain (`hashes`, kept by the caller) to its first `num_blocks` blocks."""
        b = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(chain_hash(hashes[i - 1] if i else self.salt, tokens(i * b, (i + 1) * b)))
        return hashes

    def match(self, hashes: list[bytes], tokens: TokenRange, num_tokens: int) -> list[int]:
        """Cached blocks of the longest prefix of a sequence of `num_tokens` tokens. The last token
        is never covered, so it is computed and its logits exist."""
        b = self.block_size
        self.extend_hashes(hashes, tokens, (num_tokens - 1) // b)
        hits: list[int] = []
        for i in range((num_tokens - 1) // b):
            block = self._by_hash.get(hashes[i])
            entry = self._entries.get(block) if block is not None else None
            if entry is None or entry.parent != (hashes[i - 1] if i else self.salt) \
                    or entry.tokens != tuple(tokens(i * b, (i + 1) * b)):
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def register(self, block: int, index: int, hashes: list[bytes], tokens: TokenRange) -> None:
        """`block` now holds the computed KV of the sequence's block `index` (hashes extended)."""
        h = hashes[index]
        if h in self._by_hash or block in self._entries:
            return  # another block holds this prefix already (computed side by side): keep that one
        b = self.block_size
        self._by_hash[h] = block
        self._entries[block] = _Entry(hashes[index - 1] if index else self.salt, h,
                                      tuple(tokens(index * b, (index + 1) * b)))
        self.allocator.cached.add(block)

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
        del self._by_hash[entry.hash]
