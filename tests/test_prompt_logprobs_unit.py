"""PromptLogprobs on hand-made logits: positions, chunking, recomputation after preemption."""
from __future__ import annotations

import numpy as np

from vinoserve.engine.prompt_logprobs import PromptLogprobs


def _reference(logits: np.ndarray, ids: list[int]) -> list[float]:
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    return [x[p - 1, ids[p]] - lse[p - 1] for p in range(1, len(ids))]


def test_chunks_and_a_recomputed_prefill_give_each_position_once():
    rng = np.random.default_rng(0)
    ids = [3, 1, 4, 1, 5, 9, 2]
    logits = rng.standard_normal((len(ids), 10)).astype(np.float32)
    pl = PromptLogprobs(ids, k=2)
    pl.add(0, logits[:3])
    assert pl.take() is None  # not all scored yet
    pl.add(0, logits[:4])  # preempted and recomputed from the start
    pl.add(4, logits[4:])  # the last chunk; its last row predicts the first output token
    entries = pl.take()
    assert entries[0] is None and len(entries) == len(ids)
    np.testing.assert_allclose([e[0] for e in entries[1:]], _reference(logits, ids), rtol=0, atol=1e-12)
    for p, (_, top, rank) in enumerate(entries[1:], 1):
        assert [t for t, _ in top] == list(np.argsort(-logits[p - 1], kind="stable")[:2])
        assert rank == 1 + int((logits[p - 1] > logits[p - 1, ids[p]]).sum())
    assert pl.take() is None  # handed out once
