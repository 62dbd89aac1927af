"""Drives cache eviction for the engine: scores in, blocks out, moved keys re-rotated once."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vinoserve.cache.block_manager import BlockManager
from vinoserve.cache.eviction import CacheEvictionConfig, EvictionState
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


class Evictor:
    def __init__(self, config: CacheEvictionConfig, model: ModelSpec, blocks: BlockManager,
                 cache: KVCache, in_kernel: bool) -> None:
        if model.has_sliding_windows:
            # The kernel's window counts cached tokens, which eviction compacts: a windowed layer
            # would then see further back than the model was trained to.
            raise ValueError("cache eviction does not work with sliding-window attention models "
                             f"({model.architecture}); run without --cache-eviction")
        self.config, self.model, self.blocks, self.in_kernel = config, model, blocks, in_kernel
        self.table = self.host = self._cannot_rotate = None
        try:
            rope = model.rotation_rope()
        except ValueError as e:  # eviction without rotation still works; asking for rotation is refused
            self._cannot_rotate = e
        else:
            b = blocks.block_size
            self.table = RotationTable(rope.inverse_frequencies(), b, rows=blocks.blocks_for(model.max_context) + 1)
            self.host = None if in_kernel else HostRotator(cache.keys, b, model.head_size)
        self._check_rotation(config.rotation)
        self.num_evicted_blocks = 0
        self.num_rotated_blocks = 0

    def new_sequence(self, overrides: dict | None) -> SequenceEviction | None:
        """Eviction state for a request, with its overrides of the server's settings (or None)."""
        overrides = dict(overrides or {})
        if overrides.pop("enabled", True) is False:
            return None
        cfg = self.config.with_overrides(overrides, self.blocks.block_size)
        self._check_rotation(cfg.rotation)
        layers = self.model.num_layers
        return SequenceEviction(EvictionState(cfg, layers, self.blocks.block_size), [[] for _ in range(layers)])

    def _check_rotation(self, rotation: bool) -> None:
        if rotation and self._cannot_rotate is not None:
            raise self._cannot_rotate

    @staticmethod
    def room(seq: Sequence, ev: SequenceEviction) -> int:
        """Tokens seq may add in one step before its cache must be evicted: speculative proposals
        never cross that point, so evictions happen at the token counts they would without them."""
        return ev.state.config.max_cache_size + ev.state.block_size - seq.num_cached_tokens - 1

    @staticmethod
    def score_window(ev: SequenceEviction | None, samples: bool, num_tokens: int) -> int:
        """Queries whose scores count this step: SnapKV's window at the prompt's end (and at the
        end of every prompt chunk when evicting during prefill), 1 in decode (with speculative
        proposals, those too: rejected ones' attention to earlier keys counts)."""
        if ev is None or not (samples or ev.state.config.during_prefill):
            return 0
        return min(ev.state.config.snapkv_window, num_tokens)

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
        b, n = self.blocks.block_size, seq.num_cached_tokens
        plan = ev.state.plan(n)
        if plan is None:
            return
        last_valid = n - (len(seq.block_tables[0]) - 1) * b
        for layer, evicted in enumerate(plan):
            table = seq.block_tables[layer]
            old = np.asarray(table)
            self.blocks.drop(layer, table, evicted.tolist())
            if ev.state.config.rotation:
                self._rotate(layer, ev, old, evicted, last_valid)
        seq.num_evicted_tokens += len(plan[0]) * b
        ev.state.remove(plan)
        self.num_evicted_blocks += sum(len(p) for p in plan)

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
        ev.state = EvictionState(ev.state.config, self.model.num_layers, self.blocks.block_size)
