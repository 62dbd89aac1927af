"""Token-granular eviction's data movement: a layer's kept tokens packed into its first blocks.

After a token-granular plan, the tokens a layer keeps are scattered over its blocks. They are
moved, in order, to the front of the layer's block table (the blocks past the last one filled are
then freed), and where positions are rebased each key is re-rotated by its own shift: a key
carrying position p, now at q, carries the phase of q (per-token deltas, rows of a one-token-step
table). Only blocks from the first moved or rotated token on are rewritten. Everything runs on
the host, at any cache precision: keys through their codec (quantized ones requantized with fresh
parameters), values
row by row in their stored form (every value layout the CPU plugin has is per token: a row holds
its own quantization parameters).
"""
from __future__ import annotations

import numpy as np

from vinoserve.cache.key_codec import KeyCodec
from vinoserve.cache.kv_cache import KVCache
from vinoserve.cache.rotation import RotationTable, rotate


class Compactor:
    def __init__(self, cache: KVCache, block_size: int, head_size: int, inv_freq: np.ndarray | None) -> None:
        self.block_size = block_size
        self.keys = [KeyCodec.for_tensor(t, block_size, head_size) for t in cache.keys]
        nb = cache.num_blocks
        self.values = []
        for t in cache.values:
            heads, rows = t.get_shape()[1], t.get_shape()[2]
            if rows != block_size:
                raise ValueError("token-granular eviction needs a value cache stored per token")
            self.values.append(t.data.reshape(nb, heads, block_size, -1))  # a view: writes reach the cache
        # Row d rotates a key back by d positions; grown on demand.
        self.table = RotationTable(inv_freq, 1, rows=block_size * 16) if inv_freq is not None else None

    def compact(self, layer: int, table: list[int], keep: np.ndarray, deltas: np.ndarray | None) -> int:
        """Moves the `keep` tokens (sorted logical indices) of one layer to the front of its block
        table, each key rotated back by its `deltas` positions (None: none rotated); returns how
        many tokens moved or rotated. The caller frees the blocks past len(keep)."""
        b = self.block_size
        k = len(keep)
        changed = keep != np.arange(k)
        if deltas is not None:
            changed |= deltas != 0
        moved = np.flatnonzero(changed)
        if not len(moved):
            return 0
        first = moved[0] // b * b  # rewrite from the start of the first block that changes
        src = keep[first:] - first  # token indices within the blocks read
        blocks_in = np.asarray(table[first // b:int(keep[-1]) // b + 1], dtype=np.int64)
        n_out = k - first
        out = -(-n_out // b)
        dst = blocks_in[:out]
        pad = out * b - n_out

        keys = _tokens(self.keys[layer].read(blocks_in))[src]  # [T, H, S] float32
        if deltas is not None:
            self.table.ensure(int(deltas[first:].max()))
            keys = rotate(keys.transpose(1, 0, 2)[None], self.table.table,
                          deltas[None, first:].astype(np.int64))[0].transpose(1, 0, 2)
        valid = np.full(out, b)
        valid[-1] = b - pad
        self.keys[layer].write(dst, _blocks(keys, pad, b), valid)
        values = self.values[layer]
        values[dst] = _blocks(_tokens(values[blocks_in])[src], pad, b)
        return len(moved)


def _tokens(blocks: np.ndarray) -> np.ndarray:
    """[R, H, B, X] -> [R * B, H, X]: tokens in logical order."""
    r, h, b, x = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(r * b, h, x)


def _blocks(tokens: np.ndarray, pad: int, b: int) -> np.ndarray:
    """[T, H, X] -> [ceil(T / B), H, B, X], the last block padded with zeros."""
    t, h, x = tokens.shape
    if pad:
        tokens = np.concatenate([tokens, np.zeros((pad, h, x), tokens.dtype)])
    return tokens.reshape(-1, b, h, x).transpose(0, 2, 1, 3)
