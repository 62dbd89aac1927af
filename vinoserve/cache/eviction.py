"""Attention-score cache eviction, per layer: which tokens each layer keeps once a sequence's
cache outgrows its budget.

Each layer's PagedAttention reports, per cached token, the attention it received, summed over
heads and over the step's scoring queries: the last `snapkv_window` prompt tokens at the end of
the prompt (SnapKV), one query per decoded token afterwards. Scores are max-pooled over
neighbouring tokens, so the context of an important token survives with it, and accumulated: SUM,
or NORM_SUM divided by the number of queries that could see the token, so old tokens do not win
by age. Once a sequence holds max_cache_size + block_size tokens, each layer keeps
max_cache_size of them: always the first start_size and the last recent_size tokens, and (with
protect_window) the prompt's own scoring window, where a question at the end of a prompt sits.
The rest is chosen by policy:

- "tokens": the highest-scoring tokens, one by one; the survivors are compacted into the
  layer's first blocks (and re-rotated to their new positions), so no budget is spent on the
  unimportant neighbours of an important token.
- "blocks": whole blocks by their summed score (openvino-genai's policy): nothing moves but
  the blocks after a dropped one, by whole blocks.
- "streaming": start + recent only, the oldest blocks go first (StreamingLLM); no scores used.

By default this happens once the prompt is in (the last prompt queries see the whole prompt);
with during_prefill after every prompt chunk too, each scored by its own last queries, so a
sequence never holds more than max_cache_size plus one chunk (and the block being filled),
whatever its prompt's length. All layers keep the same number of tokens (the PagedAttention op
has one past length per sequence), each layer its own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

AGGREGATIONS = ("sum", "norm_sum")
POLICIES = ("tokens", "blocks", "streaming")
# What `--cache-eviction` runs per policy, chosen by `vinoserve bench longctx` (docs/eviction.md has
# the runs): tokens scored over the prompt's last 32 queries, pooled over 31 neighbours (a needle's
# sentence survives with it), the question protected, each layer's choice half its own and half
# all layers' vote; with start 32 and recent 64 (`--cache-eviction 32,64,MAX`: the spec's recent
# tokens come out of the scored budget). "blocks" keeps the dataclass defaults: openvino-genai's
# policy (start 32, recent 128), rotated.
RECOMMENDED = {
    "tokens": dict(policy="tokens", snapkv_window=32, pool_window=31, protect_window=True, layer_mix=0.5),
    "blocks": dict(policy="blocks"),
    "streaming": dict(policy="streaming"),
}


@dataclass(frozen=True)
class CacheEvictionConfig:
    start_size: int = 32
    recent_size: int = 128
    max_cache_size: int = 672
    aggregation: str = "norm_sum"
    snapkv_window: int = 8
    rotation: bool = True
    pool_window: int = 7
    policy: str = "blocks"
    protect_window: bool = False  # never evict the prompt's last snapkv_window tokens
    # "tokens" policy: the share of the scored budget given to the most distinctive keys instead
    # (lowest cosine to the layer's mean key, KeyDiff), which no query asked for yet
    diversity: float = 0.0
    # "tokens" policy: how much each layer's choice follows all layers' (0: its own scores only,
    # 1: every layer keeps the same tokens, those most layers would keep)
    layer_mix: float = 0.0
    during_prefill: bool = False

    @classmethod
    def parse(cls, spec: str, policy: str = "tokens", **kwargs) -> CacheEvictionConfig:
        """'START,RECENT,MAX' as the CLI takes it, with the policy's recommended settings."""
        try:
            start, recent, maximum = (int(x) for x in spec.split(","))
        except ValueError as e:
            raise ValueError(f"cache_eviction must be START,RECENT,MAX (tokens), got {spec!r}") from e
        return cls(start, recent, maximum, **{**RECOMMENDED.get(policy, {"policy": policy}), **kwargs})

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
        if self.policy not in POLICIES:
            raise ValueError(f"cache_eviction.policy must be one of {', '.join(POLICIES)}")
        if not (0.0 <= self.diversity <= 1.0 and 0.0 <= self.layer_mix <= 1.0):
            raise ValueError("cache_eviction.diversity and layer_mix must be in [0, 1]")
        if self.snapkv_window < 1 or self.pool_window < 1:
            raise ValueError("cache_eviction.snapkv_window and pool_window must be >= 1")
        if self.protect_window and self.start_size + self.recent_size + self.snapkv_window > self.max_cache_size:
            raise ValueError("cache_eviction: start_size + recent_size + snapkv_window exceed max_cache_size "
                             "(protect_window keeps all three)")

    def with_overrides(self, overrides: dict, block_size: int) -> CacheEvictionConfig:
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cache_eviction fields: {', '.join(sorted(unknown))}")
        cfg = replace(self, **overrides)
        cfg.validate(block_size)
        return cfg


@dataclass(frozen=True)
class EvictionPlan:
    """Per layer, the sorted indices of the cached tokens that stay (as many in every layer)."""

    keep: list[np.ndarray]
    num_cached: int
    whole_blocks: bool  # the dropped tokens form whole blocks: drop them, move nothing within a block

    def dropped_blocks(self, block_size: int) -> list[np.ndarray]:
        """Per layer, the logical blocks none of whose tokens stay (whole-block plans)."""
        n_blocks = -(-self.num_cached // block_size)
        return [np.setdiff1d(np.arange(n_blocks), np.unique(k // block_size)) for k in self.keep]


class EvictionState:
    """Accumulated scores of one sequence's cached tokens, per layer."""

    def __init__(self, config: CacheEvictionConfig, num_layers: int, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.scores = np.zeros((num_layers, 0))
        self.times_scored = np.zeros((num_layers, 0))  # queries that could see each token
        self.protected = np.zeros((num_layers, 0), dtype=bool)  # layers keep different tokens after eviction

    def add(self, layer_scores: list[np.ndarray], window: int = 1) -> None:
        """This step's scores of all cached tokens (past + new), one array per layer, summed over
        the step's last `window` queries."""
        step = np.stack(layer_scores).astype(np.float64)
        n = step.shape[1]
        self._grow(n)
        self.scores[:, :n] += _max_pool(step, self.config.pool_window)
        # A query sees the tokens up to its own: the window's last query sees only itself.
        self.times_scored[:, :n] += np.clip(n - np.arange(n), 0, max(window, 1))

    def protect_last(self, num_cached: int, count: int) -> None:
        """Keep the last `count` of the `num_cached` tokens for good (the prompt's scoring window)."""
        self._grow(num_cached)
        self.protected[:, num_cached - count:num_cached] = True

    def _grow(self, n: int) -> None:
        def grown(a: np.ndarray) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, n - a.shape[1]))) if a.shape[1] < n else a

        self.scores, self.times_scored, self.protected = map(grown, (self.scores, self.times_scored, self.protected))

    def plan(self, num_cached: int, distinct: np.ndarray | None = None) -> EvictionPlan | None:
        """What each layer keeps; None while the cache fits (under max_cache_size + one block).
        `distinct` [layers, num_cached]: how distinctive each key is (needed with diversity)."""
        cfg, b = self.config, self.block_size
        if num_cached < cfg.max_cache_size + b:
            return None
        self._grow(num_cached)
        if cfg.policy == "tokens":
            return EvictionPlan(self._top_tokens(num_cached, distinct), num_cached, whole_blocks=False)
        excess = (num_cached - cfg.max_cache_size) // b
        first, end = cfg.start_size // b, (num_cached - cfg.recent_size) // b
        if cfg.policy == "streaming":
            dropped = [np.arange(first, first + excess)] * len(self.scores)
        else:
            per_block = self._token_scores(end * b).reshape(len(self.scores), end, b).sum(axis=2)[:, first:]
            per_block[self.protected[:, :end * b].reshape(len(self.scores), end, b).any(axis=2)[:, first:]] = np.inf
            dropped = [np.sort(row) + first for row in np.argpartition(per_block, excess - 1, axis=1)[:, :excess]]
        keep = [np.setdiff1d(np.arange(num_cached), (d[:, None] * b + np.arange(b)).ravel()) for d in dropped]
        return EvictionPlan(keep, num_cached, whole_blocks=True)

    def _token_scores(self, n: int) -> np.ndarray:
        tokens = self.scores[:, :n]
        if self.config.aggregation == "norm_sum":
            tokens = tokens / np.maximum(self.times_scored[:, :n], 1)
        return tokens

    def _top_tokens(self, n: int, distinct: np.ndarray | None) -> list[np.ndarray]:
        cfg, size = self.config, self.config.max_cache_size
        scores = self._token_scores(n).copy()
        if cfg.layer_mix:
            # Rank-based, so a layer with sharp attention does not outvote the others: each token's
            # percentile in its own layer, mixed with the share of layers that would keep it.
            rank = np.argsort(np.argsort(scores, axis=1), axis=1) / max(n - 1, 1)
            votes = (rank >= 1 - size / n).mean(axis=0)
            scores = (1 - cfg.layer_mix) * rank + cfg.layer_mix * votes
        scores[:, :cfg.start_size] = np.inf
        scores[:, n - cfg.recent_size:] = np.inf
        scores[self.protected[:, :n]] = np.inf
        if not cfg.diversity or distinct is None:
            return list(np.sort(np.argpartition(-scores, size - 1, axis=1)[:, :size], axis=1))
        keep = []
        for row, keys in zip(scores, distinct):
            forced = int(np.isinf(row).sum())
            by_score = size - int((size - forced) * cfg.diversity)
            first = np.argpartition(-row, by_score - 1)[:by_score]
            rest = np.setdiff1d(np.arange(n), first)
            extra = rest[np.argpartition(-keys[rest], size - by_score - 1)[:size - by_score]] if size > by_score else rest[:0]
            keep.append(np.sort(np.concatenate([first, extra])))
        return keep

    def retain(self, plan: EvictionPlan) -> None:
        """Only the kept tokens' scores remain, in their new (compacted) order."""
        keep = np.stack(plan.keep)
        rows = np.arange(len(keep))[:, None]
        self.scores, self.times_scored = self.scores[rows, keep], self.times_scored[rows, keep]
        self.protected = self.protected[rows, keep]


def _max_pool(x: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or x.shape[1] == 0:
        return x
    half = window // 2
    padded = np.pad(x, ((0, 0), (half, window - 1 - half)), constant_values=-np.inf)
    return sliding_window_view(padded, window, axis=1).max(axis=2)
