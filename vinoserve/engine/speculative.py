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
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Protocol

from vinoserve.engine.ngram_proposer import NgramProposer
from vinoserve.engine.step_cost import StepCost
from vinoserve.scheduler.sequence import Sequence

METHODS = ("ngram", "draft_model")
AHEAD = -1  # in a calibration plan: a plain step planned ahead of the one before it (overlapped)
# A new sequence's odds until its own proposals, verified or shadowed, show its rate. AMX, the
# built-in model, 8 prompts a workload, decode steps priced by one measured table (so that timing
# noise drops out): 0.7 yielded 1.05-1.16x what 0.5 did quoting, extracting and in open chat,
# copying and answering over a tool's output level; 0.8 no better (benchmarks/results/).
PRIOR = 0.7


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys."""

    method: str = "ngram"
    # A cap: the budget takes as many as pay. Prompt lookup on AMX, the built-in model, one stream,
    # 4 prompts a workload: 8 against 4 gave 1.08-1.11x the tokens/s copying, quoting, extracting
    # and answering over a tool's output (docs/speculative-decoding.md).
    num_speculative_tokens: int = 8
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
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer, not {raw[key]!r}")
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

    def may_propose(self, seq: Sequence) -> bool:
        """Whether a proposal is likely once the token being sampled now is appended (read from
        the tokens known now: a cheap guess, not a proposal)."""


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
class _Acceptance:
    """Decayed counts of a sequence's accepted and tried proposals (verified, or shadows scored
    as if they were): accepting each next proposal is taken as a coin with these odds, from two
    tries' worth of PRIOR at first. Its own outcomes only: a prior from every sequence's outcomes,
    as before, made a request's steps, and so its text, hang on the requests before it."""

    accepted: float = 0.0
    tried: float = 0.0

    def rate(self) -> float:
        return min((self.accepted + 2 * PRIOR) / (self.tried + 2), 0.95)

    def update(self, num_drafts: int, num_accepted: int, decay: float = 0.8) -> None:
        self.accepted = decay * self.accepted + num_accepted
        self.tried = decay * self.tried + num_accepted + (num_accepted < num_drafts)


@dataclass
class _Shadow:
    """A proposal made but not verified: drafts[i] guesses the token at position at + i."""

    drafts: list[int]
    at: int

    def outcome(self, seq: Sequence) -> int | None:
        """How many drafts the tokens since matched, once a draft missed or all were seen; None
        while the tokens so far all match."""
        seen = seq.token_ids(self.at, min(seq.num_known_tokens, self.at + len(self.drafts)))
        j = next((i for i, (d, t) in enumerate(zip(self.drafts, seen)) if d != t), len(seen))
        return j if j < len(seen) or len(seen) == len(self.drafts) else None


class Speculator:
    """Picks how many tokens each decoding sequence proposes this step, and keeps the score.

    Proposals are added, most likely first, while they raise the expected tokens per second of
    the step: a proposal whose chance of being accepted is g (its sequence's rate to the power
    of its position) is worth it while g / c > E / T, where c = b + p is its cost (b: one more
    token in the verifying step, fitted as T = a + b * tokens to steps measured before the first
    request, `StepCost`; p: the proposer's seconds per proposed token, measured then too, about
    nothing for prompt lookup, a draft model's step for a draft model) and E the tokens the step
    is expected to yield; and the step as a whole is taken only if E / T beats the plain step's
    tokens per second, overlapped (what its host work hidden behind the step before saves). A big
    batch, a slow proposer or proposals that keep failing all turn speculation off by themselves.
    Nothing in it reads the clock once the costs are measured, or another request's outcomes:
    the same request on the same server takes the same steps.

    A sequence's odds are learnt without verifying too: where prompt lookup finds a proposal
    that the budget turns down, it is kept (`_Shadow`) and checked against the tokens that
    follow. So on the one-token clone the plain step is priced as timed, with no margin left for
    new sequences to explore in, and a request that starts copying after a stretch of open chat
    still gets its proposals (benchmarks/results/2026-11-28-zen5.md)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 fast_step_tokens: int | None = None, proposal_cap: int | None = None) -> None:
        self.config = config
        # Steps of at most fast_step_tokens run on a faster compilation, and the step's cost jumps
        # past it, which a line fitted over step sizes does not see. Where proposals keep a step
        # within it (proposal_cap: the decode model's 16 tokens) the line prices them; where none
        # fits (the kernel's one-token clone) the plain step is priced as timed: 5.1 ms on the
        # built-in model where the line said 8.7 (Zen 5), and proposals at open chat's odds
        # passed for paying.
        self.proposal_cap = proposal_cap
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.cost = StepCost(0 if proposal_cap is not None else fast_step_tokens or 0, proposal_cap)
        # Shadows cost a lookup, not a draft model's call: prompt lookup only.
        self._shadows: weakref.WeakKeyDictionary[Sequence, _Shadow] | None = \
            weakref.WeakKeyDictionary() if isinstance(self.proposer, NgramProposer) else None
        self.propose_seconds = 0.0  # of the last call: the engine leaves it out of the step's cost
        self._acceptance: weakref.WeakKeyDictionary[Sequence, _Acceptance] = weakref.WeakKeyDictionary()
        self._plan: deque[int] = deque()  # while calibrating: proposals per step to come, or AHEAD

    def calibrate(self, plan: Iterable[int]) -> None:
        """The steps to come take proposals as `plan` says, one entry a step of decoding
        sequences: k proposals each (the proposer's, padded where it finds fewer), or AHEAD, a
        plain step planned ahead; the costs observed meanwhile are what the budget prices by."""
        self._plan = deque(plan)

    @property
    def calibrating(self) -> bool:
        return bool(self._plan)

    def freeze(self) -> None:
        """Calibration over: the costs stay as measured, the counters start from nothing, and a
        draft model lets go of the calibration's sequence (now finished)."""
        self._plan.clear()
        self.cost.freeze()
        self.stats = SpecStats(accepted_per_position=[0] * self.config.num_speculative_tokens)
        if (drop_finished := getattr(self.proposer, "drop_finished", None)) is not None:
            drop_finished()

    def plan_ahead(self, seqs: list[Sequence], room: list[int]) -> bool:
        """Whether the step after the one computing may be planned now, before its tokens are
        known, and so without proposals: overlapped steps hide the host's work, so a step waits
        for its tokens (to propose) only where some sequence is likely to get a proposal worth
        verifying. Open chat then costs one lookup per sequence and step, not the overlap."""
        if not seqs or len(seqs) > self.config.disable_by_batch_size:
            return True
        if self._plan:  # calibrating
            if self._plan[0] != AHEAD:
                return False
            self._plan.popleft()
            return True
        self._settle_shadows(seqs)
        self._cast_shadows(seqs)
        limits = [min(self.config.num_speculative_tokens, r - 2) for r in room]  # one token is still pending
        likely = [(seq, k) for seq, k in zip(seqs, limits) if k > 0 and self._may_propose(seq)]
        if not likely:
            return True
        fit = self.cost.fit()
        if fit is None:
            return True  # not measured: no proposals
        ks = self._budget(fit, [k for _, k in likely], [self._rate(seq) for seq, _ in likely])
        return not any(ks)

    def propose(self, seqs: list[Sequence], room: list[int]) -> None:
        """Set draft_token_ids of the decoding sequences `seqs`; room[i]: how many tokens seq i
        may still add (max_tokens, context)."""
        self.propose_seconds = 0.0
        for seq in seqs:  # each step proposes anew, also for those the last budget left unverified
            seq.draft_token_ids = []
        if not seqs or len(seqs) > self.config.disable_by_batch_size:
            return
        self._settle_shadows(seqs)
        calibrating = bool(self._plan)
        if calibrating:  # as many as the plan says, where there is room
            planned = max(self._plan.popleft(), 0)
            ks = [max(min(planned, r - 1), 0) for r in room]
        else:
            ks = self.budget([min(self.config.num_speculative_tokens, r - 1) for r in room],
                             [self._rate(seq) for seq in seqs])
        chosen = [(seq, k) for seq, k in zip(seqs, ks) if k > 0]
        self._cast_shadows([seq for seq, k in zip(seqs, ks) if k == 0])  # the chosen get a lookup below
        if not chosen:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose([s for s, _ in chosen], [k for _, k in chosen])
        self.propose_seconds = time.perf_counter() - start
        for (seq, k), drafts in zip(chosen, proposals):
            if calibrating:  # a step of the planned size, whatever the proposer found
                drafts = drafts + seq.token_ids(seq.num_known_tokens - 1, seq.num_known_tokens) * (k - len(drafts))
            seq.draft_token_ids = drafts
            if self._shadows is not None and drafts:
                self._shadows.pop(seq, None)  # the verifying step tells
        if (made := sum(map(len, proposals))) and calibrating:
            self.cost.observe_proposals(self.propose_seconds / made)

    def budget(self, limits: list[int], rates: list[float]) -> list[int]:
        """Proposals per sequence (at most limits[i]) given each one's acceptance rate."""
        fit = self.cost.fit()
        return [0] * len(limits) if fit is None else self._budget(fit, limits, rates)

    def _budget(self, fit: tuple[float, float], limits: list[int], rates: list[float]) -> list[int]:
        a, b = fit
        ks = [0] * len(limits)
        cost = b + self.cost.per_proposal
        expected, seconds = float(len(limits)), a + b * len(limits)
        # Tokens/s without speculating. From the line, where the step's cost bends (the decode
        # model: a one-token step 7-14% under the line); without shadows that margin was what let
        # a new sequence, starting from the engine's odds, get the proposals that show its own:
        # priced as timed, copying fell from 2.03x to 0.92x of plain
        # (benchmarks/results/2026-11-26-emerald-rapids.md). As timed on the one-token clone,
        # where the line is 1.5x off and shadows learn the odds.
        plain = expected / max(seconds - self.cost.overlap_saving(), 1e-9)
        if self._shadows is not None and (timed := self.cost.timed(len(limits))) is not None:
            plain = expected / timed
        offers = sorted(((rates[i] ** j, i) for i, k in enumerate(limits) for j in range(1, k + 1)), reverse=True)
        room = len(offers)
        if self.proposal_cap is not None and len(limits) <= self.proposal_cap:
            room = self.proposal_cap - len(limits)
        for gain, i in offers[:room]:
            if gain * seconds <= cost * expected:
                break
            ks[i] += 1
            expected += gain
            seconds += cost
        # Speculating at all gives up the overlap: worth it only if the step still yields more.
        return ks if expected / seconds > plain else [0] * len(limits)

    def _may_propose(self, seq: Sequence) -> bool:
        # A shadow is there just where the last lookup found a run that the tokens since follow:
        # the proposer's own guess, without a second scan of the context (350 us at 32k tokens).
        return seq in self._shadows if self._shadows is not None else self.proposer.may_propose(seq)

    def _settle_shadows(self, seqs: list[Sequence]) -> None:
        """Shadows the tokens since have settled are scored as verified proposals would be."""
        if self._shadows is None:
            return
        for seq in seqs:
            if (shadow := self._shadows.get(seq)) is not None and (matched := shadow.outcome(seq)) is not None:
                del self._shadows[seq]
                self._learn(seq, len(shadow.drafts), matched)

    def _cast_shadows(self, seqs: list[Sequence]) -> None:
        """A shadow for each sequence without one where lookup finds a proposal, from the tokens
        known now (ahead of a step, its first draft guesses the token being sampled)."""
        if self._shadows is None:
            return
        for seq in seqs:
            if seq not in self._shadows and (drafts := self.proposer.propose([seq], [self.config.num_speculative_tokens])[0]):
                self._shadows[seq] = _Shadow(drafts, seq.num_known_tokens)

    def _rate(self, seq: Sequence) -> float:
        return self._acceptance.setdefault(seq, _Acceptance()).rate()

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """The outcome of verifying num_drafts proposals of seq."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(min(num_accepted, len(s.accepted_per_position))):  # calibration's run past k (dropped)
            s.accepted_per_position[i] += 1
        self._learn(seq, num_drafts, num_accepted)

    def _learn(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self._acceptance.setdefault(seq, _Acceptance()).update(num_drafts, num_accepted)
