"""Speculative decoding: who proposes, for which sequences, how many tokens, and what came of it.

A proposal is verified inside the normal packed step (the sequence's last token plus its k
proposals, k+1 logits rows); the engine samples those rows in order exactly as it would without
speculation and keeps proposals while they equal what it sampled. Proposals are deterministic
(prompt lookup, or a draft model's greedy choice), so this "sample and compare" rule is the
rejection-sampling rule for a one-hot draft distribution: the output distribution, and with a seed
the output itself, are those of plain decoding.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field, fields
from typing import Protocol

from vinoserve.engine.ngram_proposer import NgramProposer
from vinoserve.scheduler.sequence import Sequence

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # the draft model (draft_model)
    weight_format: str = "int8"  # the draft model's weights, when converted from GGUF
    # Speculation stops while more sequences than this are decoding: a big batch already keeps
    # the CPU busy, and verifying proposals would only add work to it.
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, text: str | dict) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming any unknown key or bad value."""
        raw = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})")
        if "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(raw["prompt_lookup_max"], cls.prompt_lookup_min)
        if "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
            raw["prompt_lookup_max"] = max(raw["prompt_lookup_min"], cls.prompt_lookup_max)
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('method "draft_model" needs "model": a path or built-in name')
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow each sequence's last token."""


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: proposals made, tokens proposed, tokens accepted, and
    acceptances by position (position i accepted means the first i+1 proposals were)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the accepted proposals and the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Backoff:
    misses: int = 0  # proposals rejected in a row
    resume_at: int = 0  # the step from which it may propose again


class Speculator:
    """Picks the sequences that speculate this step and keeps the score."""

    MAX_BACKOFF_STEPS = 16

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._backoff: weakref.WeakKeyDictionary[Sequence, _Backoff] = weakref.WeakKeyDictionary()
        self._step = 0

    def propose(self, seqs: list[Sequence], room: list[int]) -> None:
        """Set draft_token_ids of the decoding sequences `seqs`; room[i]: how many tokens seq i
        may still add (max_tokens, context). A sequence whose proposals keep failing waits a
        while (doubling) before it proposes again."""
        self._step += 1
        if not seqs or len(seqs) > self.config.disable_by_batch_size:
            return
        chosen, ks = [], []
        for seq, r in zip(seqs, room):
            k = min(self.config.num_speculative_tokens, r - 1)
            b = self._backoff.get(seq)
            if k > 0 and (b is None or b.resume_at <= self._step):
                chosen.append(seq)
                ks.append(k)
        for seq, drafts in zip(chosen, self.proposer.propose(chosen, ks) if chosen else []):
            seq.draft_token_ids = drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """The outcome of verifying num_drafts proposals of seq."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        b = self._backoff.setdefault(seq, _Backoff())
        b.misses = 0 if num_accepted else b.misses + 1
        b.resume_at = self._step + 1 + min(2 ** b.misses - 1, self.MAX_BACKOFF_STEPS) if b.misses else 0
