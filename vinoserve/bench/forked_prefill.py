"""Many cache-eviction settings on one prefill: the long-context benchmark's runner for vinoserve.

Eviction after the prompt makes every setting's prefill identical up to the prompt's scoring
window. So each prompt is prefilled once, without scores, up to its last `tail` tokens (the
largest SnapKV window of the settings); each setting (a fork) then gets its own copy of those
blocks in every layer, computes the tail with its own score window, evicts and decodes greedily,
all forks batched in one step. The steps use the engine's own parts and fields exactly as its
step loop does (runner, block manager, Evictor calls, ScheduledChunk fields), so a fork's tokens
are the tokens LLMEngine generates for the same prompt and setting without speculation: a test
checks that at f32.
A 4K prefill takes about 20 s on 2 busy cores; a fork's tail and 30 decode steps, about 2 s.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import asdict, dataclass

import numpy as np

from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.evictor import Evictor, SequenceEviction
from vinoserve.engine.llm_engine import LLMEngine
from vinoserve.engine.model_runner import ScheduledChunk
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.sequence import Sequence


@dataclass(eq=False)
class _Fork:
    seq: Sequence
    ev: SequenceEviction | None
    done: bool = False


class ForkedPrefill:
    def __init__(self, engine: LLMEngine, chunk: int = 1024) -> None:
        if engine.evictor is None:
            raise ValueError("the engine must be built with cache eviction (any setting)")
        self.engine, self.chunk = engine, chunk
        self.blocks, self.runner, self.evictor = engine.blocks, engine.runner, engine.evictor
        self.peak_blocks = 0  # most blocks one fork held per layer after its first eviction

    def generate(self, prompt: Seq[int], settings: Seq[CacheEvictionConfig | None], max_tokens: int,
                 done: Callable[[list[int]], bool] = lambda ids: False) -> list[list[int]]:
        """Greedy tokens for each setting (None: the full cache), stopping at EOS, max_tokens, or
        once `done(tokens)`: a scorer that has seen every answer need not read more."""
        if any(s is not None and s.during_prefill for s in settings):
            raise ValueError("forked prefill computes the prompt once, without eviction: no during_prefill settings")
        prompt = list(prompt)
        windows = [s.snapkv_window for s in settings if s is not None]
        prefix = len(prompt) - max(windows, default=1)
        base = self._sequence("base", prompt)
        try:
            self.blocks.grow(base.block_tables, prefix)
            for start in range(0, prefix, self.chunk):
                end = min(start + self.chunk, prefix)
                self.runner.step([ScheduledChunk(prompt[start:end], start, base.block_tables, 0)])
            base.num_computed_tokens = prefix
            forks = [self._fork(base, i, s) for i, s in enumerate(settings)]
        finally:
            self.blocks.free(base.block_tables)
        try:
            self._run(forks, prompt[prefix:], max_tokens, done)
        finally:
            for f in forks:
                self._release(f)
        return [f.seq.output_token_ids for f in forks]

    def _sequence(self, name: str, prompt: list[int]) -> Sequence:
        return Sequence(name, prompt, SamplingParams(temperature=0), block_tables=self.blocks.new_tables())

    def _fork(self, base: Sequence, i: int, setting: CacheEvictionConfig | None) -> _Fork:
        seq = self._sequence(f"fork{i}", base.prompt_token_ids)
        self.blocks.grow(seq.block_tables, base.num_computed_tokens)
        cache = self.engine.cache
        for layer, (src, dst) in enumerate(zip(base.block_tables, seq.block_tables)):
            for tensors in (cache.keys, cache.values):
                data = tensors[layer].data.reshape(cache.num_blocks, -1)
                data[dst] = data[src]
        seq.num_computed_tokens = base.num_computed_tokens
        ev = self.evictor.new_sequence(asdict(setting)) if setting is not None else None
        return _Fork(seq, ev)

    def _run(self, forks: list[_Fork], tail: list[int], max_tokens: int, done) -> None:
        first = True
        while live := [f for f in forks if not f.done]:
            chunks = []
            for f in live:
                seq = f.seq
                tokens = tail if first else seq.output_token_ids[-1:]
                self.blocks.grow(seq.block_tables, seq.num_cached_tokens + len(tokens))
                position = Evictor.first_position(seq, f.ev)
                chunks.append(ScheduledChunk(tokens, seq.num_cached_tokens, seq.block_tables, 1, position,
                                             Evictor.score_window(f.ev, seq, len(tokens), True)))
            rotation = self.evictor.kernel_rotation([f.ev for f in live if f.ev is not None])
            result = self.runner.step(chunks, rotation)
            offset = 0
            for f, chunk, row in zip(live, chunks, result.rows):
                seq = f.seq
                seq.num_computed_tokens += len(chunk.token_ids)
                n = chunk.past_len + len(chunk.token_ids)
                if chunk.score_window:
                    f.ev.state.add([layer[offset:offset + n] for layer in result.scores], chunk.score_window)
                offset += n
                token = int(np.argmax(row))
                seq.output_token_ids.append(token)
                ids = seq.output_token_ids
                f.done = (token in self.engine.eos_token_ids or len(ids) >= max_tokens or done(ids))
                if f.ev is not None and not f.done:
                    self.evictor.evict_if_full(seq, f.ev)
                    if seq.num_evicted_tokens:
                        self.peak_blocks = max(self.peak_blocks, len(seq.block_tables[0]))
                if f.done:
                    self._release(f)
            first = False

    def _release(self, f: _Fork) -> None:
        f.done = True
        self.blocks.free(f.seq.block_tables)
        if f.ev is not None:
            self.evictor.forget(f.ev)
