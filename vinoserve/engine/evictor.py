"""Drives cache eviction for the engine: scores in, tokens out, keys re-rotated where positions rebase.

What a step loop calls, in order (this interface is kept stable; eviction during chunked prefill
uses the same calls on every chunk):

- `new_sequence(overrides)` once per request: its eviction state, or None (eviction off for it).
- `score_window(ev, seq, num_tokens, samples)` when building a chunk: how many of the chunk's
  last queries must report attention scores (ScheduledChunk.score_window). In the prompt, the
  queries among its last `snapkv_window` tokens, whichever chunks they fall in; in decode, the
  step's tokens.
- `kernel_rotation(evictions)` for the step's inputs (in-kernel rotation of whole moved blocks).
- after the step: `ev.state.add(scores_per_layer, chunk.score_window)` for each chunk that
  scored, then `evict_if_full(seq, ev)`; it may be called after any chunk, mid-prompt too: it
  evicts only once the cache holds max_cache_size + block_size tokens, and afterwards the
  sequence holds at most max_cache_size + block_size - 1 tokens in every layer.
- `room(seq, ev)`: tokens a step may add before the next eviction (speculative proposals).
- `forget(ev)` when the sequence's blocks are freed (finish, abort, preemption).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vinoserve.cache.block_manager import BlockManager
from vinoserve.cache.compaction import Compactor
from vinoserve.cache.eviction import CacheEvictionConfig, EvictionPlan, EvictionState
from vinoserve.cache.kv_cache import KVCache
from vinoserve.cache.rotation import HostRotator, LayerRotation, RotationTable
from vinoserve.engine.model_runner import KernelRotation
from vinoserve.model.spec import ModelSpec
from vinoserve.scheduler.sequence import Sequence


@dataclass(eq=False)
class SequenceEviction:
    state: EvictionState
    # In-kernel rotations wait for the sequence's next step and are sent exactly once.
    pending: list[list[LayerRotation]] = field(default_factory=list)
    window_protected: bool = False  # the prompt's scoring window is marked to stay
    # RoPE positions [layers, K] of the first K cached tokens where the last eviction kept them
    # where they were computed; every later token (all of them after a rebase, K = 0) sits at its
    # cache index + shift.
    positions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    shift: int = 0

    def kept_positions(self, plan: EvictionPlan) -> np.ndarray:
        """[layers, kept]: the positions the kept tokens' keys carry now."""
        layers, n, k = len(plan.keep), plan.num_cached, self.positions.shape[1]
        later = np.broadcast_to(np.arange(k, n) + self.shift, (layers, n - k))
        return np.concatenate([self.positions, later], axis=1)[np.arange(layers)[:, None], np.stack(plan.keep)]


class Evictor:
    def __init__(self, config: CacheEvictionConfig, model: ModelSpec, blocks: BlockManager,
                 cache: KVCache, in_kernel: bool, max_step_tokens: int) -> None:
        if model.has_sliding_windows:
            # The kernel's window counts cached tokens, which eviction compacts: a windowed layer
            # would then see further back than the model was trained to.
            raise ValueError("cache eviction does not work with sliding-window attention models "
                             f"({model.architecture}); run without --cache-eviction")
        self.config, self.model, self.blocks, self.in_kernel = config, model, blocks, in_kernel
        # A sequence grows by at most a block and a step between two evictions: the positions
        # it may still take before the next one, and rebase after.
        self.headroom = blocks.block_size + max_step_tokens
        self.table = self.host = self._cannot_rotate = None
        inv_freq = None
        try:
            rope = model.rotation_rope()
        except ValueError as e:  # eviction without rotation still works; asking for rotation is refused
            self._cannot_rotate = e
        else:
            b, inv_freq = blocks.block_size, rope.inverse_frequencies()
            self.table = RotationTable(inv_freq, b, rows=blocks.blocks_for(model.max_context) + 1)
            self.host = None if in_kernel else HostRotator(cache.keys, b, model.head_size)
        try:
            self.compactor = Compactor(cache, blocks.block_size, model.head_size, inv_freq)
        except ValueError as e:  # a cache layout tokens cannot be moved in: block policies only
            self.compactor, self._cannot_compact = None, e
        self._check(config)
        self.num_evicted_blocks = 0  # block-table entries freed, summed over layers
        self.num_rotated_blocks = 0  # blocks re-rotated (token policy: blocks' worth of rotated keys)
        self.num_moved_tokens = 0  # tokens moved or re-rotated (token policy), summed over layers

    def new_sequence(self, overrides: dict | None) -> SequenceEviction | None:
        """Eviction state for a request, with its overrides of the server's settings (or None)."""
        overrides = dict(overrides or {})
        if overrides.pop("enabled", True) is False:
            return None
        cfg = self.config.with_overrides(overrides, self.blocks.block_size)
        self._check(cfg)
        layers = self.model.num_layers
        return SequenceEviction(EvictionState(cfg, layers, self.blocks.block_size), [[] for _ in range(layers)],
                                positions=np.zeros((layers, 0), dtype=np.int64))

    def _check(self, cfg: CacheEvictionConfig) -> None:
        if cfg.rotation and self._cannot_rotate is not None:
            raise self._cannot_rotate
        if cfg.policy == "tokens" and self.compactor is None:
            raise ValueError(f"cache_eviction.policy tokens: {self._cannot_compact}")

    @staticmethod
    def room(seq: Sequence, ev: SequenceEviction) -> int:
        """Tokens seq may add in one step before its cache must be evicted: speculative proposals
        never cross that point, so evictions happen at the token counts they would without them."""
        return ev.state.config.max_cache_size + ev.state.block_size - seq.num_cached_tokens - 1

    @staticmethod
    def first_position(seq: Sequence, ev: SequenceEviction | None) -> int | None:
        """The RoPE position of seq's next token (None: its cache length, no eviction): after an
        eviction that kept positions, new tokens go on from where the sequence was."""
        return None if ev is None else seq.num_cached_tokens + ev.shift

    @staticmethod
    def score_window(ev: SequenceEviction | None, seq: Sequence, num_tokens: int, samples: bool) -> int:
        """Queries of a chunk of `num_tokens` starting at seq.num_computed_tokens whose scores
        count: in decode the step's tokens (proposals too: rejected ones' attention to earlier
        keys counts); in the prompt those among the last snapkv_window tokens before the first
        sample, so a window split over two chunks is scored whole, and with during_prefill every
        chunk's own last snapkv_window; so too every chunk recomputing generated tokens after a
        preemption (evicting as their decode steps did: such a sequence may be longer than the
        context)."""
        if ev is None:
            return 0
        window = ev.state.config.snapkv_window
        if seq.is_decoding:
            return min(window, num_tokens) if samples else 0
        if ev.state.config.during_prefill or seq.num_computed_tokens >= len(seq.prompt_token_ids):
            return min(window, num_tokens)
        end = seq.num_computed_tokens + num_tokens
        return max(0, min(num_tokens, end - (seq.num_known_tokens - window)))

    def kernel_rotation(self, evictions: list[SequenceEviction]) -> KernelRotation | None:
        if not self.in_kernel or not any(r for ev in evictions for r in ev.pending):
            return None
        blocks, deltas = [], []
        for layer in range(self.model.num_layers):
            parts = [r for ev in evictions for r in ev.pending[layer]]
            blocks.append(np.concatenate([r.blocks for r in parts]).astype(np.int32) if parts
                          else np.zeros(0, np.int32))
            deltas.append(np.concatenate([r.deltas for r in parts]).astype(np.int32) if parts
                          else np.zeros((0, 1), np.int32))
        for ev in evictions:
            ev.pending = [[] for _ in ev.pending]
        return KernelRotation(self.table.table, blocks, deltas)

    def evict_if_full(self, seq: Sequence, ev: SequenceEviction) -> None:
        n, cfg = seq.num_cached_tokens, ev.state.config
        mid_prompt = seq.num_computed_tokens < len(seq.prompt_token_ids)
        if not cfg.during_prefill and mid_prompt:
            return  # the prompt's scoring window is not all in yet
        if cfg.protect_window and not ev.window_protected and not mid_prompt:
            ev.state.protect_last(n, min(cfg.snapkv_window, n))  # right after the prompt: its last tokens
            ev.window_protected = True
        distinct = self._distinct(seq, n) if cfg.diversity and n >= cfg.max_cache_size + self.blocks.block_size else None
        plan = ev.state.plan(n, distinct)
        if plan is None:
            return
        kept, k = ev.kept_positions(plan), len(plan.keep[0])
        next_position = n + ev.shift
        if plan.whole_blocks:  # openvino-genai's policies rebase (rotate) at every eviction
            self._drop_blocks(seq, ev, plan)
            rebase = cfg.rotation
        else:
            rebase = cfg.rotation and (mid_prompt or self.must_rebase(next_position))
            self._compact(seq, plan, kept - np.arange(k) if rebase else None)
        seq.num_evicted_tokens += n - k
        ev.state.retain(plan)
        ev.positions = kept[:, :0] if rebase else kept
        ev.shift = 0 if rebase else next_position - k

    def must_rebase(self, next_position: int) -> bool:
        """Token policy: once the prompt is in, kept keys stay at the positions they were computed
        at (which kept more on retrieval than packing them together) until the positions would run
        past the model's context; then all are re-rotated onto 0, 1, 2, ... and the sequence goes
        on. Evicting mid-prompt always rebases: the chunks still to come are computed against a
        dense past, as in training (8K needles at 2,048: 3/3 rebased, 0/3 kept; docs/eviction.md)."""
        return next_position + self.headroom > self.model.max_context

    def rebases(self, cfg: CacheEvictionConfig) -> bool:
        """Whether a sequence evicting with `cfg` keeps its positions inside the context however
        long it runs."""
        return cfg.rotation and cfg.max_cache_size + self.headroom <= self.model.max_context

    def _distinct(self, seq: Sequence, n: int) -> np.ndarray:
        """[layers, n]: minus each key's cosine to its layer's mean key, averaged over KV heads."""
        out = []
        for layer, table in enumerate(seq.block_tables):
            keys = self.compactor.keys[layer].read(np.asarray(table))  # [R, H, B, S]
            keys = keys.transpose(0, 2, 1, 3).reshape(-1, keys.shape[1], keys.shape[3])[:n]
            unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-6)
            mean = unit.mean(axis=0)
            mean /= np.maximum(np.linalg.norm(mean, axis=-1, keepdims=True), 1e-6)
            out.append(-(unit * mean).sum(axis=-1).mean(axis=1))
        return np.stack(out)

    def _compact(self, seq: Sequence, plan: EvictionPlan, deltas: np.ndarray | None) -> None:
        keep_blocks = self.blocks.blocks_for(len(plan.keep[0]))
        for layer, keep in enumerate(plan.keep):
            table = seq.block_tables[layer]
            moved = self.compactor.compact(layer, table, keep, None if deltas is None else deltas[layer])
            self.num_moved_tokens += moved
            if deltas is not None:  # counted in blocks' worth of re-rotated keys, as the block policies count
                self.num_rotated_blocks += -(-moved // self.blocks.block_size)
            self.num_evicted_blocks += len(table) - keep_blocks
            self.blocks.drop(layer, table, list(range(keep_blocks, len(table))))

    def _drop_blocks(self, seq: Sequence, ev: SequenceEviction, plan: EvictionPlan) -> None:
        b, n = self.blocks.block_size, plan.num_cached
        last_valid = n - (len(seq.block_tables[0]) - 1) * b
        for layer, evicted in enumerate(plan.dropped_blocks(b)):
            table = seq.block_tables[layer]
            old = np.asarray(table)
            self.blocks.drop(layer, table, evicted.tolist())
            if ev.state.config.rotation:
                self._rotate(layer, ev, old, evicted, last_valid)
            self.num_evicted_blocks += len(evicted)

    def _rotate(self, layer: int, ev: SequenceEviction, old: np.ndarray, evicted: np.ndarray,
                last_valid: int) -> None:
        """Blocks after an evicted one move down by (evicted before them) blocks: rotate them back."""
        idx = np.arange(len(old))
        shift = np.searchsorted(evicted, idx)  # evicted blocks before each index
        moved = ~np.isin(idx, evicted) & (shift > 0)
        if not moved.any():
            return
        rotation = LayerRotation(
            blocks=old[moved].astype(np.int32),
            deltas=shift[moved].astype(np.int32)[:, None],
            valid_tokens=np.where(idx[moved] == len(old) - 1, last_valid, self.blocks.block_size),
        )
        self.table.ensure(int(shift.max()))
        if self.in_kernel:
            ev.pending[layer].append(rotation)
        else:
            self.host.apply(layer, rotation, self.table)
        self.num_rotated_blocks += int(moved.sum())

    def forget(self, ev: SequenceEviction) -> None:
        """The sequence's blocks were freed (finish, abort, preemption): its rotations are void."""
        ev.pending = [[] for _ in ev.pending]
        ev.window_protected = False
        ev.positions, ev.shift = ev.positions[:, :0], 0
        ev.state = EvictionState(ev.state.config, self.model.num_layers, self.blocks.block_size)
