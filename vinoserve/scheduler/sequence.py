"""A request's token sequence and its lifecycle through the scheduler."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from vinoserve.scheduler import media
from vinoserve.scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; waits to be recomputed from its tokens
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens the model has processed
    num_evicted_tokens: int = 0  # of those, dropped from the cache by the eviction policy
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # per group (1, or per layer)
    finish_reason: str | None = None  # "stop" | "length" | "abort", as the OpenAI API names them
    num_preemptions: int = 0
    # Prefix caching: chained hashes of its full blocks so far (tokens never change, so they stay
    # valid through preemption), how many of its table's blocks are registered in the cache, and
    # the prompt tokens its first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    # Speculative decoding: tokens proposed to follow the last one, verified by the next step
    # (never part of output_token_ids until the model agrees with them).
    draft_token_ids: list[int] = field(default_factory=list)
    # Overlapped steps: the token a step in flight will sample for it, counted in num_tokens (the
    # next step is planned with it) before it is known and appended to output_token_ids.
    num_pending_tokens: int = 0
    # The most blocks a table of it ever holds where that is bounded (eviction during prefill:
    # the budget plus one step); the scheduler admits it only with room to get there.
    most_blocks: int | None = None
    # Rows of embeddings in place of prompt tokens' (media.py), in prompt order, checked.
    images: tuple[media.ImageSpan, ...] = ()

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def ends_with_pending(self) -> bool:
        """The token being sampled for it is its last (max_tokens): nothing more to compute."""
        done = len(self.output_token_ids) + self.num_pending_tokens
        return self.num_pending_tokens > 0 and done >= self.params.max_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= len(self.prompt_token_ids)

    def same_prompt(self, ids: list[int], images: tuple[media.ImageSpan, ...]) -> bool:
        """Whether a prompt gives the same KV as its own (a fork shares its blocks)."""
        return self.prompt_token_ids == ids and media.same_images(self.images, images)

    def extra_keys(self, start: int, stop: int) -> bytes:
        """What besides its tokens fixes the KV of [start, stop) (prefix caching): its images there."""
        return media.extra_keys(self.images, start, stop) if self.images else b""

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Known tokens in [start, stop): a pending one is not there yet."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:  # decoding: no copy of the prompt every step
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]
