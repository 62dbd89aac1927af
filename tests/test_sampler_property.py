"""The batch sampler against a slow reference, on generated batches: whatever the filters,
penalties, masking and ties, every token drawn is one the row allows."""
from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from test_sampler import sample, state
from vinoserve.scheduler.sampler import SamplingState
from vinoserve.scheduler.sampling_params import SamplingParams


def allowed(raw: np.ndarray, s: SamplingState) -> np.ndarray:
    """A slow float64 reference of the tokens a row may produce, generous at rounding edges."""
    p = s.params
    x = raw.astype(np.float64)
    seen = sorted(set(s.prompt_token_ids) | set(s.output_token_ids))
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    counts = np.bincount(s.output_token_ids, minlength=len(x))[:len(x)]
    x -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
    if len(s.output_token_ids) < p.min_tokens:
        x[list(s.eos_token_ids + p.stop_token_ids)] = -np.inf
    ok = np.isfinite(x)
    if not ok.any():
        return ok
    tol = 1e-4 * (1 + np.abs(x[ok]).max())
    if p.is_greedy:
        return ok & (x >= x.max() - tol)
    top_k = p.top_k if p.top_k > 0 else len(x)
    ok &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1] - tol
    prob = np.where(ok, np.exp((x - x.max()) / p.temperature), 0.0)
    ok &= prob >= p.min_p * (1 - 1e-4)
    prob = np.where(ok, prob, 0.0)
    # The mass of the tokens strictly more likely than each one, ties counted in its favour.
    ascending = np.sort(prob)
    mass = np.concatenate([[0.0], np.cumsum(ascending)])
    above = mass[-1] - mass[np.searchsorted(ascending, prob * (1 + 1e-4), side="right")]
    return ok & (above < p.top_p * mass[-1] * (1 + 1e-4))


params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    temperature=st.sampled_from([0.0, 0.05, 0.7, 1.0, 2.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    top_k=st.sampled_from([0, -1, 1, 2, 5, 40]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 0.8, 1.5]),
    presence_penalty=st.sampled_from([0.0, 1.0, -2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.5, 2.0]),
    stop_token_ids=st.sampled_from([(), (0,), (1, 2)]),
    min_tokens=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.tuples(params_strategy, st.lists(st.integers(0, 7), max_size=6)), min_size=1, max_size=6),
    vocab=st.sampled_from([3, 8, 100, 2500]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    ties=st.booleans(),
    masked=st.sampled_from([0.0, 0.3, 0.9]),
    data_seed=st.integers(0, 2**32),
)
def test_sampled_tokens_are_always_allowed(rows, vocab, scale, ties, masked, data_seed):
    rng = np.random.default_rng(data_seed)
    logits = rng.standard_normal((len(rows), vocab)) * scale
    if ties:
        logits = np.round(logits)
    logits[rng.random(logits.shape) < masked] = -np.inf
    states = [state(p, prompt=[3 % vocab, 4 % vocab], output=[t % vocab for t in out], eos=[5 % vocab])
              for p, out in rows]
    refs = [allowed(row, s) for row, s in zip(logits.astype(np.float32), states)]
    assume(all(r.any() for r in refs))
    tokens = sample(logits, states)
    for t, ref, row in zip(tokens, refs, logits):
        assert np.isfinite(row[t]) and ref[t]
