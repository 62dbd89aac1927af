"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or its output.

Copying workloads (summaries, code edits, RAG answers, JSON rewrites) repeat long runs of their
input, so the proposal is often what the model would write anyway; it costs no model call."""
from __future__ import annotations

import weakref

import numpy as np

from vinoserve.scheduler.sequence import Sequence


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Up to k tokens following the latest earlier match of the longest suffix of `tokens` of
    length n in [n_min, n_max]; empty when even the n_min-token suffix never occurred before."""
    size = len(tokens)
    if size <= n_min or k <= 0:
        return tokens[:0]
    # ends[i]: a match of the last n tokens ends just before position ends[i] (< size, so that
    # something follows it); extended one token to the left per round while any match survives.
    ends = np.arange(n_min, size)
    keep = np.ones(len(ends), dtype=bool)
    for j in range(1, n_min + 1):
        keep &= tokens[ends - j] == tokens[size - j]
    ends = ends[keep]
    n = n_min
    while len(ends) and n < n_max:
        longer = ends[ends > n]
        longer = longer[tokens[longer - n - 1] == tokens[size - n - 1]]
        if not len(longer):
            break
        ends, n = longer, n + 1
    if not len(ends):
        return tokens[:0]
    start = int(ends[-1])  # the latest: recent context is the likeliest to be copied on
    return tokens[start:start + k]


class NgramProposer:
    """Proposes from each sequence's own tokens; keeps one growing token array per sequence so a
    step costs a vectorised scan, not a list conversion."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._tokens: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [find_continuation(self._array(seq), self.n_min, self.n_max, k).tolist() for seq, k in zip(seqs, ks)]

    def may_propose(self, seq: Sequence) -> bool:
        """The known tokens' shortest suffix occurred before: while a sequence copies a run of its
        context, each step's suffix does, so the next one's (a token longer) likely will too."""
        return len(find_continuation(self._array(seq), self.n_min, self.n_min, 1)) > 0

    def _array(self, seq: Sequence) -> np.ndarray:
        buf, size = self._tokens.get(seq, (None, 0))
        total = seq.num_known_tokens  # a token still being sampled is not there yet
        if buf is None or len(buf) < total:
            grown = np.empty(max(2 * total, 256), dtype=np.int64)
            if buf is not None:
                grown[:size] = buf[:size]
            buf = grown
        if size < total:
            buf[size:total] = seq.token_ids(size, total)
        self._tokens[seq] = (buf, total)
        return buf[:total]
