"""Continuous batching: running sequences first (oldest first), then new prompts, in chunks that
fill a token budget; preemption by recompute when KV blocks run out. First come, first served."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vinoserve.cache.block_manager import BlockManager
from vinoserve.scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 256
    # Admission leaves this share of blocks free, so running decodes do not preempt at once.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens
    samples: bool  # the chunk reaches the last token, so a next token is sampled from it

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledSequence:
        return cls(seq, num_tokens, seq.num_computed_tokens + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._watermark = int(config.watermark * blocks.num_blocks)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget and len(out.scheduled) < self.config.max_num_seqs:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, n, out):
                break  # seq itself was the newest and got preempted
            self.blocks.grow(seq.block_tables, seq.num_cached_tokens + n)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget and len(out.scheduled) < self.config.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            reserve = self._watermark if self.running else 0
            if not self.blocks.can_grow(seq.block_tables, seq.num_cached_tokens + n, reserve):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.blocks.grow(seq.block_tables, seq.num_cached_tokens + n)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
        return out

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow by n; False if seq went too."""
        while not self.blocks.can_grow(seq.block_tables, seq.num_cached_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop its KV; its tokens so far (prompt + output) are prefilled again later.
        self.blocks.free(seq.block_tables)
        seq.num_computed_tokens = seq.num_evicted_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, reason: str) -> None:
        """Retire a sequence (finished or aborted), wherever it is; its blocks return at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_tables)
        seq.status = status
        seq.finish_reason = reason
