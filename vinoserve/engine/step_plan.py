"""A step as the engine launches it: the scheduler's plan turned into the runner's chunks, and
which logits rows are sampled for whom."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vinoserve.engine.evictor import Evictor
from vinoserve.engine.model_runner import PreparedStep, ScheduledChunk
from vinoserve.engine.request_state import RequestState
from vinoserve.scheduler import media
from vinoserve.scheduler.scheduler import ScheduledSequence, SchedulerOutput
from vinoserve.scheduler.sequence import Sequence


class SamplingRow(NamedTuple):
    """A request sampled this step: the first logits row it samples, and the proposals it
    verifies on the rows after it."""

    req: RequestState
    row: int
    num_drafts: int


@dataclass(eq=False)
class Launch:
    """A step set up on the runner (and, once started, computing)."""

    plan: SchedulerOutput
    reqs: list[RequestState]
    chunks: list[ScheduledChunk]
    prepared: PreparedStep
    waiting_on: list[Sequence]  # whose last input token the step before it is still sampling
    sampling: list[SamplingRow]
    every_row: bool  # the sampling rows are all the logits rows, in order
    computed: list[tuple[Sequence, int]] = field(default_factory=list)  # each one's computed tokens once it ran

    @property
    def decode_tokens(self) -> int:
        """Its token count if every sequence in it was decoding (proposals included), else 0."""
        if all(s.num_tokens == 1 + s.num_drafts for s in self.plan.scheduled):
            return self.plan.num_batched_tokens
        return 0


def chunk(s: ScheduledSequence, req: RequestState) -> ScheduledChunk:
    """The runner's view of one scheduled sequence: its new tokens (a placeholder -1 for one the
    step in flight is still sampling, then its proposals) and where its KV lives."""
    seq, ev = s.seq, req.eviction
    start = seq.num_computed_tokens
    wanted = 1 + s.num_drafts if s.samples else 0
    if req.prompt_logprobs is not None:
        wanted = req.prompt_logprobs.logits_wanted(start, s.num_tokens, s.samples)
    end = start + s.num_tokens - s.num_drafts
    tokens = seq.token_ids(start, end)
    if len(tokens) < end - start:  # its last is being sampled by the step in flight: filled in at launch
        tokens = tokens + [-1]
    if s.num_drafts:
        tokens = tokens + seq.draft_token_ids
    # exactly the image rows this chunk's positions take: a span cut by the budget is fed in parts,
    # and a recomputed (preempted) prompt is fed them again
    images = [(at - start, rows) for at, rows in media.rows_in(seq.images, start, end)] if seq.images else ()
    first, rope = Evictor.first_position(seq, ev), None
    if seq.images and seq.images[0].grid is not None:
        first, rope = _rope_positions(seq, start, len(tokens), first)
    return ScheduledChunk(tokens, seq.num_cached_tokens, seq.block_tables, wanted, first,
                          Evictor.score_window(ev, seq, s.num_tokens, s.samples),
                          prompt=start < len(seq.prompt_token_ids) or end - start > 1, images=images,
                          rope_positions=rope)


def _rope_positions(seq: Sequence, start: int, num_tokens: int, first: int | None) -> tuple[int, np.ndarray | None]:
    """M-RoPE: the chunk's first position past the images before it, and where it holds image
    rows, its three position streams; both moved as an eviction moved the first position."""
    base = seq.num_cached_tokens if first is None else first
    rope = media.rope_positions(seq.images, start, start + num_tokens)
    return base + media.rope_shift(seq.images, start), None if rope is None else rope + (base - start)


def sampling_rows(plan: SchedulerOutput, reqs: list[RequestState],
                  chunks: list[ScheduledChunk]) -> tuple[list[SamplingRow], int]:
    """The requests sampled this step, and the step's number of logits rows. A sampling chunk's
    rows end with its own row and one per proposal; the first of those is sampled first. Python
    only: in the overlapped loop this runs while a step computes, where numpy calls between two
    steps each cost ~8 us."""
    sampling, end = [], 0
    for s, r, c in zip(plan.scheduled, reqs, chunks):
        end += c.num_logits
        if s.samples:
            sampling.append(SamplingRow(r, end - 1 - s.num_drafts, s.num_drafts))
    return sampling, end
