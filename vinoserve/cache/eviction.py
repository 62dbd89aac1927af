"""Attention-score cache eviction (SnapKV/H2O style), per layer, in whole blocks.

Each layer's PagedAttention reports, per cached token, the attention it received (summed over
heads and over the last `snapkv_window` prompt queries at the end of prefill, one query per
decode step). Scores are max-pooled over neighbouring tokens, so a block keeps the context of an
important token, and accumulated: SUM, or NORM_SUM divided by how often a token was scored so old
tokens do not win by age. Once a sequence's cache reaches max_cache_size + block_size tokens,
each layer drops its lowest-scoring whole blocks between the first start_size tokens and the last
recent_size tokens until it fits again. By default that happens only once the prompt is in (the
last prompt queries see the whole prompt); with during_prefill it happens after every prompt chunk
too, each scored by its own last queries, so a sequence never holds more than max_cache_size plus
one chunk (and the block being filled), whatever its prompt's length.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

AGGREGATIONS = ("sum", "norm_sum")


@dataclass(frozen=True)
class CacheEvictionConfig:
    start_size: int = 32
    recent_size: int = 128
    max_cache_size: int = 672
    aggregation: str = "norm_sum"
    snapkv_window: int = 8
    rotation: bool = True
    pool_window: int = 7
    during_prefill: bool = False

    @classmethod
    def parse(cls, spec: str, **kwargs) -> CacheEvictionConfig:
        """'START,RECENT,MAX' as the CLI takes it."""
        try:
            start, recent, maximum = (int(x) for x in spec.split(","))
        except ValueError as e:
            raise ValueError(f"cache_eviction must be START,RECENT,MAX (tokens), got {spec!r}") from e
        return cls(start, recent, maximum, **kwargs)

    def validate(self, block_size: int) -> None:
        for name in ("start_size", "recent_size", "max_cache_size"):
            value = getattr(self, name)
            if value < 0 or value % block_size:
                raise ValueError(f"cache_eviction.{name} must be a non-negative multiple of the block size "
                                 f"{block_size}, got {value}")
        if self.max_cache_size < self.start_size + self.recent_size:
            # With max >= start + recent there are always enough evictable blocks to fit again.
            raise ValueError(f"cache_eviction.max_cache_size ({self.max_cache_size}) must be at least "
                             f"start_size + recent_size ({self.start_size + self.recent_size})")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"cache_eviction.aggregation must be one of {', '.join(AGGREGATIONS)}")
        if self.snapkv_window < 1 or self.pool_window < 1:
            raise ValueError("cache_eviction.snapkv_window and pool_window must be >= 1")

    def with_overrides(self, overrides: dict, block_size: int) -> CacheEvictionConfig:
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cache_eviction fields: {', '.join(sorted(unknown))}")
        cfg = replace(self, **overrides)
        cfg.validate(block_size)
        return cfg


class EvictionState:
    """Accumulated scores of one sequence's cached tokens, per layer."""

    def __init__(self, config: CacheEvictionConfig, num_layers: int, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.scores = np.zeros((num_layers, 0))
        self.times_scored = np.zeros((num_layers, 0))  # layers keep different tokens after eviction

    def add(self, layer_scores: list[np.ndarray]) -> None:
        """This step's scores of all cached tokens (past + new), one array per layer."""
        step = np.stack(layer_scores).astype(np.float64)
        grow = step.shape[1] - self.scores.shape[1]
        if grow > 0:
            self.scores = np.pad(self.scores, ((0, 0), (0, grow)))
            self.times_scored = np.pad(self.times_scored, ((0, 0), (0, grow)))
        self.scores += _max_pool(step, self.config.pool_window)
        self.times_scored += 1

    def plan(self, num_cached: int) -> list[np.ndarray] | None:
        """Per layer, the sorted logical block indices to evict; None while the cache fits."""
        cfg, b = self.config, self.block_size
        excess_blocks = (num_cached - cfg.max_cache_size) // b
        if excess_blocks < 1:
            return None
        first, end = cfg.start_size // b, (num_cached - cfg.recent_size) // b
        tokens = self.scores[:, :end * b]
        if cfg.aggregation == "norm_sum":
            tokens = tokens / np.maximum(self.times_scored[:, :end * b], 1)
        per_block = tokens.reshape(len(tokens), end, b).sum(axis=2)[:, first:]
        lowest = np.argpartition(per_block, excess_blocks - 1, axis=1)[:, :excess_blocks]
        return [np.sort(row) + first for row in lowest]

    def remove(self, evicted: list[np.ndarray]) -> None:
        b, n = self.block_size, self.scores.shape[1]
        keep = np.ones((len(evicted), n), dtype=bool)
        for layer, blocks in enumerate(evicted):
            for blk in blocks:
                keep[layer, blk * b:(blk + 1) * b] = False
        self.scores = self.scores[keep].reshape(len(evicted), -1)
        self.times_scored = self.times_scored[keep].reshape(len(evicted), -1)


def _max_pool(x: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or x.shape[1] == 0:
        return x
    half = window // 2
    padded = np.pad(x, ((0, 0), (half, window - 1 - half)), constant_values=-np.inf)
    return sliding_window_view(padded, window, axis=1).max(axis=2)
