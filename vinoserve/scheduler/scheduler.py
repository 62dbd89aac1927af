"""Continuous batching: running sequences first (oldest first), then new prompts, in chunks that
fill a token budget; preemption by recompute when KV blocks run out. First come, first served."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vinoserve.cache.block_manager import BlockManager, Hit
from vinoserve.scheduler import media
from vinoserve.scheduler.sequence import Sequence, SequenceStatus

# The fewest tokens of a prompt one step computes where it has the choice: the rest after a
# prefix-cache hit, the last chunk of a long prompt. Below about this a chunk's tokens take other
# kernels than a long chunk's (built-in model on AMX: 1-4 tokens moved the first token's logits
# by 0.3-0.6 at bf16, 1 token by 0.009 at f32; 5 and more gave them bit for bit), so a prompt's
# answer hung on how much of it the prefix cache held and where the step budget cut it. Where
# the budget cuts a prompt, it cuts at a block's end: a u8 cache quantizes keys per block, and a
# block written in two steps holds other keys (0.44 on the first token's logits, AMX).
MIN_PROMPT_CHUNK = 16


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 256  # chosen by measurement: benchmarks/results/2026-11-23-zen4.md
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
    num_drafts: int = 0  # of num_tokens, proposed tokens after the last one, to verify

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, num_drafts: int = 0) -> ScheduledSequence:
        return cls(seq, num_tokens, seq.num_computed_tokens + num_tokens - num_drafts == seq.num_tokens, num_drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy before the step

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
            if seq.ends_with_pending:  # finishes once the step in flight samples it
                i += 1
                continue
            if self.blocks.releases:  # 0.3-0.4 us a sequence a step for nothing without a window
                self.blocks.release_behind(seq.block_tables, seq.num_computed_tokens)
            n = self._chunk(seq, seq.num_cached_tokens, seq.num_uncomputed_tokens, budget)
            drafts = self._fit_drafts(seq, n, budget)
            if not self._make_room(seq, n + drafts, out):
                break  # seq itself was the newest and got preempted
            out.copies += self.blocks.own_blocks_at(seq.block_tables, seq.num_cached_tokens)
            self.blocks.grow(seq.block_tables, seq.num_cached_tokens + n + drafts)
            out.scheduled.append(ScheduledSequence.of(seq, n + drafts, drafts))
            n += drafts
            budget = max(0, budget - n)
            i += 1
        pending = self._pending_hashes()
        # Sequences whose KV is bounded (eviction during prefill) get room to reach their bound:
        # admitting one that would later preempt another wastes a whole prompt's recompute.
        growth = sum(max(0, s.most_blocks - len(s.block_tables[0])) for s in self.running
                     if s.most_blocks) if self.waiting else 0  # a walk over every running sequence: only to admit
        w = 0
        while w < len(self.waiting) and budget and len(out.scheduled) < self.config.max_num_seqs \
                and not out.preempted:
            seq = self.waiting[w]
            hits = self._cached_prefix(seq)
            if self._waits_for(seq, len(hits), pending):
                w += 1  # its next blocks are being computed by a running sequence: take them when done
                continue
            start = len(hits) * self.blocks.block_size
            n = self._chunk(seq, start, seq.num_tokens - start, budget)
            reserve = (self._watermark if self.running else 0) + growth
            needed = self.blocks.admission_cost(hits, start + n)
            if max(needed, seq.most_blocks or 0) + reserve > self.blocks.num_free_blocks:
                break  # first come, first served: nobody overtakes the head of the queue for memory
            del self.waiting[w]
            self._admit(seq, hits)
            self.blocks.grow(seq.block_tables, seq.num_cached_tokens + n)
            growth += max(0, (seq.most_blocks or 0) - len(seq.block_tables[0]))
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget = max(0, budget - n)
            pending |= self._uncomputed_hashes(seq)
        return out

    @property
    def _least_chunk(self) -> int:
        return min(MIN_PROMPT_CHUNK, self.config.max_num_batched_tokens // 2)

    def _chunk(self, seq: Sequence, cached: int, remaining: int, budget: int) -> int:
        """Tokens of a sequence's uncomputed `remaining` (after its `cached` ones) to compute this
        step: all of them where the budget allows, else up to the last block's end that leaves at
        least MIN_PROMPT_CHUNK for later (where the budget reaches none, what it allows); never
        inside an image whose rows attend both ways (media.whole_images_end)."""
        n = min(remaining, budget)
        if n == remaining:
            return n
        end = cached + min(n, remaining - self._least_chunk)
        end -= end % self.blocks.block_size
        n = end - cached if end > cached else n
        return media.whole_images_end(seq.images, cached, cached + n) - cached if seq.images else n

    def _fit_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of seq's proposed tokens to verify this step: they count against the token
        budget, and are dropped rather than preempt anyone for their blocks."""
        if not seq.draft_token_ids:
            return 0
        fit = min(len(seq.draft_token_ids), max(0, budget - n)) if n == seq.num_uncomputed_tokens else 0
        copies = self.blocks.copies_needed(seq.block_tables, seq.num_cached_tokens)
        if fit and not self.blocks.can_grow(seq.block_tables, seq.num_cached_tokens + n + fit, copies):
            fit = 0
        del seq.draft_token_ids[fit:]
        return fit

    def rollback(self, seq: Sequence) -> None:
        """After verification: blocks that only held rejected proposals go back."""
        seq.draft_token_ids.clear()
        self.blocks.trim(seq.block_tables, seq.num_cached_tokens + seq.num_uncomputed_tokens)

    # ---- prefix caching
    def _cached_prefix(self, seq: Sequence) -> list[Hit]:
        """Cached blocks `seq` can start from ([] without prefix caching)."""
        if self.blocks.prefix is None or _scores_prompt(seq):
            return []
        hits = self.blocks.match_prefix(seq.block_hashes, seq.token_ids, seq.num_tokens, seq.extra_keys)
        while hits and seq.num_tokens - len(hits) * self.blocks.block_size < self._least_chunk:
            hits.pop()  # the rest is computed as a chunk of a prompt computed whole would be
        while hits and media.inside_whole_image(seq.images, len(hits) * self.blocks.block_size):
            hits.pop()
        return hits

    def _waits_for(self, seq: Sequence, num_hits: int, pending: set[bytes]) -> bool:
        """Whether `seq`'s next block is being computed by a running sequence. A block cached
        already is no reason to wait: its hit was given up so the rest computes as one chunk
        (MIN_PROMPT_CHUNK), and waiting on it let one same-prompt request in a step."""
        if _scores_prompt(seq) or num_hits >= len(seq.block_hashes):
            return False
        h = seq.block_hashes[num_hits]
        return h in pending and not self.blocks.prefix.is_cached(h)

    def _admit(self, seq: Sequence, hits: list[Hit]) -> None:
        first = seq.status is SequenceStatus.WAITING
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self.blocks.prefix is None:
            return
        self.blocks.adopt(seq.block_tables, hits, len(hits) * self.blocks.block_size)
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.blocks.block_size
        if first:  # a preempted sequence finding its own blocks again is no prefix hit
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            self.blocks.prefix.record_lookup(seq.num_tokens, seq.num_computed_tokens)

    def _uncomputed_hashes(self, seq: Sequence) -> set[bytes]:
        """Hashes of the full blocks `seq` is about to compute, which others can wait for."""
        if self.blocks.prefix is None:
            return set()
        done = seq.num_computed_tokens // self.blocks.block_size
        return set(seq.block_hashes[done:])

    def _pending_hashes(self) -> set[bytes]:
        pending: set[bytes] = set()
        for seq in self.running:
            pending |= self._uncomputed_hashes(seq)
        return pending

    def cache_computed(self, computed: list[tuple[Sequence, int]]) -> None:
        """Register the blocks a step fills, given each sequence's computed tokens once it has run
        (a later step may have moved num_computed_tokens past it). Call any time after it is
        launched: a step that reads them runs after it. A block whose last token is still being
        sampled is left for a later call."""
        prefix = self.blocks.prefix
        if prefix is None:
            return
        for seq, num_computed in computed:
            full = min(num_computed, seq.num_known_tokens) // self.blocks.block_size
            if full <= seq.num_registered_blocks or seq.status is not SequenceStatus.RUNNING:
                continue  # nothing new, or its blocks went back since (preempted, finished)
            prefix.extend_hashes(seq.block_hashes, seq.token_ids, full, seq.extra_keys)
            for i in range(seq.num_registered_blocks, full):
                self.blocks.register(seq.block_tables, i, seq.block_hashes, seq.token_ids, seq.extra_keys)
            seq.num_registered_blocks = full

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow by n; False if seq went too."""
        while not self.blocks.can_grow(seq.block_tables, seq.num_cached_tokens + n,
                                       self.blocks.copies_needed(seq.block_tables, seq.num_cached_tokens)):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (same prompt) starts where `parent` is, on its blocks, and runs from now on."""
        child.block_tables = self.blocks.fork(parent.block_tables)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        child.num_pending_tokens = parent.num_pending_tokens  # its first token is sampled with the parent's
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop its KV; its tokens so far (prompt + output) are prefilled again later.
        self.blocks.free(seq.block_tables)
        seq.num_computed_tokens = seq.num_evicted_tokens = seq.num_registered_blocks = 0
        seq.draft_token_ids.clear()
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


def _scores_prompt(seq: Sequence) -> bool:
    """A request asking for prompt logprobs needs logits at every prompt token: it computes them all."""
    return seq.params.prompt_logprobs is not None
