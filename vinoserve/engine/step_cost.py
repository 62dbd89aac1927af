"""What a step costs on this machine, for this model: the figures speculation prices proposals by."""
from __future__ import annotations

import numpy as np


class StepCost:
    """Seconds per step as a + b * tokens: what one more token in a step costs on this machine,
    for this model. Measured before the first request (`engine/calibration.py`: each size a few
    times, the least taken, as the step's own cost without what else ran), then frozen: priced
    from live timings, whether a step speculated, and with it the text at reduced precision,
    moved with the machine's load, and the same request came back different (issue 59).

    The line is fitted to steps run one at a time, as every step that verifies proposals is;
    steps planned ahead of the one before them (overlapped) are kept apart, and what they save
    at the same size is the price of speculating at all (`overlap_saving`). Steps of at most
    `timed_up_to` tokens run on a faster compilation that no proposal fits in (the kernel's
    one-token clone): a plain step of that size is priced as timed (`timed`). Where proposals
    keep a step within a faster compilation (`fitted_up_to`, the decode model's 16 tokens), the
    line is fitted over the sizes it runs. `per_proposal`: the proposer's seconds per proposed
    token (about nothing for prompt lookup, a draft model's step for a draft model)."""

    def __init__(self, timed_up_to: int = 0, fitted_up_to: int | None = None) -> None:
        self.timed_up_to = timed_up_to
        self.fitted_up_to = fitted_up_to
        self.frozen = False
        self.per_proposal = 0.0
        self._proposals_seen = False
        self._seconds: dict[int, float] = {}
        self._overlapped: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float, overlapped: bool = False) -> None:
        if self.frozen:
            return
        table = self._overlapped if overlapped else self._seconds
        table[num_tokens] = min(seconds, table.get(num_tokens, seconds))

    def observe_proposals(self, seconds_per_token: float) -> None:
        if self.frozen:
            return
        self.per_proposal = min(self.per_proposal, seconds_per_token) if self._proposals_seen else seconds_per_token
        self._proposals_seen = True

    def freeze(self) -> None:
        self.frozen = True

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None unless steps of at least three sizes were seen."""
        sizes = [n for n in self._seconds if self.fitted_up_to is None or n <= self.fitted_up_to]
        if len(sizes) < 3:
            return None
        b, a = np.polyfit(np.array(sizes, np.float64), np.array([self._seconds[n] for n in sizes], np.float64), 1)
        return max(a, 1e-6), max(b, 1e-9)

    def timed(self, num_tokens: int) -> float | None:
        """A plain step's seconds as timed (overlapped where it ran so), for the sizes on the
        faster compilation; None for other sizes, or before one was seen."""
        if num_tokens > self.timed_up_to:
            return None
        return self._overlapped.get(num_tokens, self._seconds.get(num_tokens))

    def overlap_saving(self) -> float:
        """Seconds an overlapped step saves against one run alone, at the sizes seen both ways."""
        both = self._seconds.keys() & self._overlapped.keys()
        if not both:
            return 0.0
        return max(0.0, float(np.mean([self._seconds[n] - self._overlapped[n] for n in both])))

    def figures(self) -> dict:
        """What was measured, as JSON can keep it."""
        return {"seconds": self._seconds, "overlapped": self._overlapped, "per_proposal": self.per_proposal}

    def load(self, figures: dict) -> None:
        """Takes figures as `figures()` gave them, and freezes; KeyError or ValueError if malformed."""
        self._seconds = {int(n): float(s) for n, s in figures["seconds"].items()}
        self._overlapped = {int(n): float(s) for n, s in figures["overlapped"].items()}
        self.per_proposal = float(figures["per_proposal"])
        self.freeze()
