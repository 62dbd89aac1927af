"""Log-probabilities of a request's prompt tokens (echo, vLLM's prompt_logprobs), gathered from the
logits of its prefill chunks: the logits row of prompt position p scores the token at p + 1."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Per prompt token: (its logprob, the top k (id, logprob), its rank from 1), or None for the first token
PromptLogprob = tuple[float, list[tuple[int, float]], int] | None


@dataclass(eq=False)
class PromptLogprobs:
    prompt_token_ids: list[int]
    k: int  # top alternatives per position, besides the prompt's own token
    entries: list[PromptLogprob] = field(default_factory=lambda: [None])
    delivered: bool = False

    def logits_wanted(self, start: int, num_tokens: int, samples: bool) -> int:
        """Rows of logits a chunk of `num_tokens` from `start` needs: all of them while in the prompt."""
        return num_tokens if start < len(self.prompt_token_ids) else int(samples)

    def add(self, start: int, rows: np.ndarray) -> None:
        """Record the logits rows [n, V] of prompt positions start, start + 1, ..."""
        # A prefill recomputed after preemption scores positions again: keep the first scores.
        skip = max(0, len(self.entries) - (start + 1))
        targets = self.prompt_token_ids[start + 1 + skip:start + 1 + len(rows)]
        if not targets:
            return
        rows = rows[skip:skip + len(targets)].astype(np.float64)  # log-softmax in f64: no rounding of our own
        peak = rows.max(axis=1, keepdims=True)
        lse = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
        own = rows[np.arange(len(targets)), targets]
        chosen = own - lse
        rank = 1 + (rows > own[:, None]).sum(axis=1)
        top = np.argsort(-rows, axis=1, kind="stable")[:, :self.k] if self.k else np.zeros((len(rows), 0), int)
        for i, t in enumerate(targets):
            self.entries.append((float(chosen[i]), [(int(j), float(rows[i, j] - lse[i])) for j in top[i]], int(rank[i])))

    def take(self) -> list[PromptLogprob] | None:
        """All entries, once the whole prompt is scored and not yet handed out."""
        if self.delivered or len(self.entries) < len(self.prompt_token_ids):
            return None
        self.delivered = True
        return self.entries
