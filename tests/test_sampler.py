"""The batch sampler: filters, penalties, masking, seeding and logprobs, on hand-made logits."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vinoserve.scheduler.penalties import penalise
from vinoserve.scheduler.sampler import Sampler, SamplingState, make_rng
from vinoserve.scheduler.sampling_params import SamplingParams

GRID = 20000  # uniforms per distribution check: frequencies are exact to 1 / GRID


class FixedUniform:
    """Stands in for a row's generator, so a test chooses where the inverse CDF lands."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def state(params: SamplingParams, prompt=(), output=(), eos=()) -> SamplingState:
    return SamplingState(params, list(prompt), list(output), tuple(eos))


def sample(logits, states) -> np.ndarray:
    return Sampler().sample(np.asarray(logits, dtype=np.float32), states).token_ids


def distribution(logits_row, params: SamplingParams, grid: int = GRID, **kw) -> np.ndarray:
    """The sampled distribution, read off by sweeping a grid of uniforms through the sampler."""
    states = []
    for i in range(grid):
        s = state(params, **kw)
        s.rng = FixedUniform((i + 0.5) / grid)
        states.append(s)
    tokens = sample(np.repeat(np.asarray(logits_row, np.float32)[None], grid, axis=0), states)
    return np.bincount(tokens, minlength=len(logits_row)) / grid


def softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_greedy_is_argmax_and_draws_nothing():
    logits = np.random.default_rng(0).standard_normal((8, 1000))
    states = [state(SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.3)) for _ in range(8)]
    before = [s.rng.bit_generator.state for s in states]
    assert np.array_equal(sample(logits, states), logits.astype(np.float32).argmax(axis=1))
    assert [s.rng.bit_generator.state for s in states] == before


def test_a_random_row_takes_exactly_one_uniform_per_step():
    for params in [SamplingParams(seed=3), SamplingParams(top_k=1, seed=3),
                   SamplingParams(top_p=0.5, top_k=4, min_p=0.2, seed=3), SamplingParams(top_p=0.3, seed=3)]:
        s = state(params)
        for _ in range(3):
            sample(np.random.default_rng(4).standard_normal((1, 50)), [s])
        reference = make_rng(3)
        reference.random(3)
        assert s.rng.bit_generator.state == reference.bit_generator.state, params


@pytest.mark.parametrize("temperature", [1e-3, 0.5, 1.0, 7.0])
def test_top_k_1_is_greedy(temperature):
    rng = np.random.default_rng(1)
    logits = np.round(rng.standard_normal((32, 3000)) * 2, 1)  # rounded: ties at the top too
    greedy = sample(logits, [state(SamplingParams(temperature=0)) for _ in range(32)])
    params = SamplingParams(temperature=temperature, top_k=1, top_p=0.3, min_p=0.5)
    assert np.array_equal(sample(logits, [state(params) for _ in range(32)]), greedy)


TARGETS = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7),
    SamplingParams(temperature=1.3, top_p=0.95, seed=7),
    SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2, seed=7),
]


@pytest.mark.parametrize("target", TARGETS)
def test_seed_reproduces_whatever_the_batch(target):
    vocab, steps = 3001, 50  # over one 1024-column block, and not a multiple of it
    world = np.random.default_rng(2)
    target_logits = world.standard_normal((steps, vocab)) * 2
    others = [SamplingParams(temperature=0.9, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=1.1, top_p=0.8, seed=3), SamplingParams(temperature=0.5),
              SamplingParams(temperature=1.0, top_k=50, seed=9), SamplingParams(min_p=0.1),
              SamplingParams(temperature=2.0, top_p=0.5, top_k=200)]

    def run(position: int | None) -> list[int]:
        me = state(target, prompt=[1, 2, 3])
        batch = [me] if position is None else [state(p, prompt=[4]) for p in others]
        if position is not None:
            batch.insert(position, me)
        for step in range(steps):
            logits = world.standard_normal((len(batch), vocab)) * 2
            logits[next(i for i, s in enumerate(batch) if s is me)] = target_logits[step]
            tokens = sample(logits, batch)
            for s, t in zip(batch, tokens):
                s.output_token_ids.append(int(t))
        return me.output_token_ids

    alone = run(None)
    assert len(set(alone)) > 10  # it really sampled
    for position in (0, 3, 7):
        assert run(position) == alone


def test_unseeded_rows_differ():
    states = [state(SamplingParams()) for _ in range(8)]
    seqs = np.stack([sample(np.zeros((8, 1000)), states) for _ in range(20)], axis=1)
    assert len({tuple(s) for s in seqs}) == 8


def test_negative_and_huge_seeds_are_usable():
    assert make_rng(-1).random() == make_rng(-1).random()
    assert make_rng(2**70).random() != make_rng(1).random()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = [2.0, 1.9, -1.0, -1.2, 0.5, 0.0]
    seen = dict(prompt=[0, 0], output=[2])  # token 0 from the prompt, token 2 from the output
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample([logits], [state(greedy, **seen)])[0] == 1  # 2.0 / 2 drops below 1.9
    assert sample([logits], [state(SamplingParams(temperature=0), **seen)])[0] == 0
    got = distribution(logits, SamplingParams(repetition_penalty=2.0), **seen)
    np.testing.assert_allclose(got, softmax([1.0, 1.9, -2.0, -1.2, 0.5, 0.0]), atol=2 / GRID)


def test_presence_and_frequency_penalties_hit_output_tokens_only():
    logits = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = distribution(logits, params, prompt=[0, 1, 1], output=[2, 2, 2, 3])
    expected = softmax([0.0, 0.0, -(0.5 + 3 * 0.25), -(0.5 + 1 * 0.25), 0.0, 0.0])
    np.testing.assert_allclose(got, expected, atol=2 / GRID)
    # A prompt token keeps its lead; a negative penalty pulls an output token ahead.
    greedy = replace(params, temperature=0)
    assert sample([[1.0, 0.9, 0.0]], [state(greedy, prompt=[0] * 50)])[0] == 0
    pull = SamplingParams(temperature=0, presence_penalty=-0.2)
    assert sample([[1.0, 0.9, 0.0]], [state(pull, output=[1])])[0] == 1


def test_penalties_follow_an_output_as_it_grows():
    # The tallies behind the penalties are kept step by step; each step must penalise exactly as a
    # recount of the prompt and the whole output would (a reference written out here).
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((2, 300)) * 3).astype(np.float32)
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3),
              SamplingParams(frequency_penalty=-0.5)]
    states = [state(p, prompt=list(rng.integers(0, 300, 40))) for p in params]
    for step in range(60):
        for s in states:  # tokens that recur, and enough new ones to outgrow the tallies' first arrays
            s.output_token_ids.append(int(rng.integers(0, 300 if step % 2 else 30)))
        got = penalise(logits, states)
        for row, s in enumerate(states):
            x = logits[row].astype(np.float64)
            seen = np.unique(np.concatenate([s.prompt_token_ids, s.output_token_ids]).astype(int))
            if s.params.repetition_penalty != 1.0:
                x[seen] = np.where(x[seen] > 0, x[seen] / s.params.repetition_penalty, x[seen] * s.params.repetition_penalty)
            counts = np.bincount(s.output_token_ids, minlength=300)
            x -= s.params.presence_penalty * (counts > 0) + s.params.frequency_penalty * counts
            np.testing.assert_allclose(got[row], x, rtol=1e-6, atol=1e-5)  # float32 against float64


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = [[0.0, 1.0, 0.0, 9.0, 0.0, 10.0]]  # eos 5 first, stop id 3 next
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(3,), ignore_eos=ignore_eos)
    for done, expected in [(0, 1), (1, 1), (2, 1), (3, 5), (7, 5)]:
        assert sample(logits, [state(params, output=[0] * done, eos=[5])])[0] == expected
    got = distribution(logits[0], replace(params, temperature=1.0), output=[0], eos=[5])
    np.testing.assert_allclose(got, softmax([0.0, 1.0, 0.0, -np.inf, 0.0, -np.inf]), atol=2 / GRID)


def shuffled(probs, order) -> np.ndarray:
    """Logits putting probs[i] on token order[i], so the best tokens are not the first ids."""
    logits = np.full(len(order), -np.inf)
    logits[list(order)] = np.log(probs)
    return logits


def test_top_p_keeps_the_smallest_set_reaching_it():
    order = [3, 0, 4, 1, 2]
    logits = shuffled([0.45, 0.35, 0.12, 0.05, 0.03], order)
    params = SamplingParams(top_p=0.7, seed=11)
    s = state(params)
    tokens = np.array([sample([logits], [s])[0] for _ in range(2000)])
    assert set(tokens) == {3, 0}
    assert abs(np.mean(tokens == 3) - 0.45 / 0.8) < 0.05
    expected = np.zeros(5)
    expected[[3, 0]] = [0.45 / 0.8, 0.35 / 0.8]
    np.testing.assert_allclose(distribution(logits, params), expected, atol=2 / GRID)
    kept = np.flatnonzero(distribution(logits, replace(params, top_p=0.81)))
    assert sorted(kept) == [0, 3, 4]


def test_top_p_is_taken_after_top_k():
    logits = shuffled([0.3, 0.25, 0.2, 0.15, 0.1], [2, 4, 0, 1, 3])
    got = distribution(logits, SamplingParams(top_k=3, top_p=0.6))  # of 0.3, 0.25, 0.2
    expected = np.zeros(5)
    expected[[2, 4]] = [0.3 / 0.55, 0.25 / 0.55]
    np.testing.assert_allclose(got, expected, atol=2 / GRID)


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = shuffled([0.5, 0.3, 0.12, 0.08], [1, 3, 0, 2])
    got = distribution(logits, SamplingParams(min_p=0.2))  # threshold 0.1
    expected = np.array([0.12, 0.5, 0.0, 0.3]) / 0.92
    np.testing.assert_allclose(got, expected, atol=2 / GRID)


def test_inverse_cdf_spans_blocks_of_the_vocabulary():
    probs = {100: 0.2, 1030: 0.3, 1500: 0.1, 2400: 0.4}  # blocks of 1024 columns, one empty
    logits = np.full(2500, -np.inf)
    logits[list(probs)] = np.log(list(probs.values()))
    got = distribution(logits, SamplingParams(), grid=4000)
    np.testing.assert_allclose(got[list(probs)], list(probs.values()), atol=2 / 4000)


def test_a_uniform_next_to_1_picks_the_last_weighted_token_and_never_past_it():
    # Weights 1 and 0.75 ulp(1): their float32 block sum rounds up to 1 + ulp, past what the
    # float64 cumsum inside the block reaches, so the two levels of the inverse CDF disagree
    # and the draw would land on an unweighted column without the clamp. (A row of one block or
    # less takes one float64 cumsum instead, which cannot disagree with itself.)
    logits = np.full((1, 2048), -np.inf, dtype=np.float32)
    logits[0, :2] = [0.0, -16.23]
    s = state(SamplingParams())
    s.rng = FixedUniform(np.nextafter(1.0, 0.0))
    assert sample(logits, [s])[0] == 1


def test_a_uniform_next_to_1_stays_inside_its_row_among_wider_rows():
    # Candidate rows are padded with zero weights to the batch's widest: row 0 keeps 2 tokens,
    # row 1 fifty; u next to 1 must draw row 0's second best, not a padded column.
    logits = np.random.default_rng(4).standard_normal((2, 500)).astype(np.float32)
    states = [state(SamplingParams(top_k=2)), state(SamplingParams(top_k=50))]
    for s in states:
        s.rng = FixedUniform(np.nextafter(1.0, 0.0))
    assert sample(logits, states)[0] == np.argsort(-logits[0])[1]


def test_top_p_nucleus_wider_than_the_candidate_guess():
    logits = -np.arange(2100, dtype=np.float32) * 1e-4  # nearly flat: ~1300 tokens reach 0.6
    cumulative = np.cumsum(softmax(logits))
    keep = int(np.searchsorted(cumulative, 0.6) + 1)
    got = distribution(logits, SamplingParams(top_p=0.6), grid=4000)
    assert keep > 1024 and set(np.flatnonzero(got)) == set(range(keep))


def test_top_k_looks_past_the_first_gap_for_its_best():
    # The next best after the first lie 20 logits (10 at temperature 2) below it, past the first
    # gap (8 x temperature): the search for the 3 best looks further; u next to 1 draws the third.
    logits = np.full(3000, -60.0, dtype=np.float32)
    logits[[7, 2500, 40, 1200]] = [0.0, -20.0, -20.5, -21.0]
    s = state(SamplingParams(temperature=2.0, top_k=3))
    s.rng = FixedUniform(np.nextafter(1.0, 0.0))
    assert sample([logits], [s])[0] == 40
    s = state(SamplingParams(temperature=2.0, top_k=3))
    s.rng = FixedUniform(0.5)
    assert sample([logits], [s])[0] == 7


def test_top_p_nucleus_reaching_past_the_first_gap():
    # A token of weight 1 and 2000 of weight e^-14 (14 logits down): top_p 0.9995 of the whole
    # takes the best and, in column order, as many of the rest as reach it.
    logits = np.full(2001, -14.0, dtype=np.float32)
    logits[1000] = 0.0
    tail = np.float64(np.exp(np.float32(-14.0)))
    total = 1.0 + 2000 * tail
    kept = int(np.ceil((0.9995 * total - 1.0) / tail))  # tail tokens whose weight before them is short of it
    s = state(SamplingParams(top_p=0.9995))
    s.rng = FixedUniform(np.nextafter(1.0, 0.0))
    tail_columns = [c for c in range(2001) if c != 1000]
    assert sample([logits], [s])[0] == tail_columns[kept - 1]


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 500)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.7, repetition_penalty=1.3, top_k=10, logprobs=5)
    states = [state(params, prompt=[1, 2]), state(replace(params, logprobs=0)),
              state(replace(params, logprobs=None))]
    out = Sampler().sample(logits, states)
    for i in (0, 1):
        expected = log_softmax(logits[i])
        assert out.logprobs[i] == pytest.approx(expected[out.token_ids[i]], abs=1e-5)
    assert np.isnan(out.logprobs[2])
    expected = log_softmax(logits[0])
    ids = [t for t, _ in out.top_logprobs[0]]
    assert ids == list(np.argsort(-expected)[:5])
    values = [v for _, v in out.top_logprobs[0]]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, expected[ids], atol=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    assert out.logprobs.dtype == np.float32 and out.token_ids.dtype == np.int64


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                    dict(temperature=0.8, top_k=5), dict(temperature=0.8, top_k=1),
                                    dict(temperature=0.0, logprobs=2)])
@pytest.mark.parametrize("poison, reason", [(np.nan, "NaN"), (None, "every token is excluded")])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_row_with_nan_or_nothing_allowed_raises_rather_than_draw_a_token(params, poison, reason):
    # Before: argmax returned the NaN's column as if chosen, temperature 1 drew token 0, top_p /
    # top_k raised an IndexError; now a clear error, which the engine confines to the request
    # whose row it is (test_fault_isolation).
    logits = np.random.default_rng(3).standard_normal((3, 800)).astype(np.float32)
    if poison is None:
        logits[1] = -np.inf
    else:
        logits[1, 17] = poison
    states = [state(SamplingParams(**params)) for _ in range(3)]
    with pytest.raises(ValueError, match=reason):
        Sampler().sample(logits, states)
    out = Sampler().sample(logits[[0, 2]], [states[0], states[2]])  # the others alone are fine
    assert np.isfinite(logits[[0, 2]][[0, 1], out.token_ids]).all()


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                    dict(temperature=0.8, top_k=5), dict(temperature=0.8, min_p=0.1)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_penalty_that_overflows_a_logit_makes_its_token_certain(params):
    # A repetition_penalty near 0 divides a positive logit past float32's range: +inf is the
    # draw's limit as that logit grows, so the token (the first of equals) is taken, not refused.
    logits = np.random.default_rng(9).standard_normal((3, 800)).astype(np.float32)
    logits[1, [40, 70]] = [2.0, 3.0]
    states = [state(SamplingParams(**params)), state(SamplingParams(repetition_penalty=5e-324, **params), prompt=[70, 40]),
              state(SamplingParams(**params))]
    tokens = sample(logits, states)
    assert tokens[1] == 40 and np.isfinite(logits[[0, 2]][[0, 1], tokens[[0, 2]]]).all()


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(temperature=1.0, seed=8), dict(temperature=0.5, top_k=1)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_batch_that_raised_leaves_its_seeded_rows_drawing_as_undisturbed(bad):
    # The engine samples each request alone after the batch raises: a seeded neighbour must then
    # take the uniform it would have taken, not the next one, on this step and every later one.
    logits = np.random.default_rng(6).standard_normal((2, 800)).astype(np.float32)
    logits[1, 3] = np.nan
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    states = [state(params), state(SamplingParams(**bad))]
    with pytest.raises(ValueError, match="NaN"):
        Sampler().sample(logits, states)
    undisturbed = state(params)
    for _ in range(20):
        assert sample(logits[:1], [states[0]]) == sample(logits[:1], [undisturbed])


def test_a_token_reports_one_logprob_as_chosen_and_among_the_top():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((8, 3000)).astype(np.float32) * 4
    out = Sampler().sample(logits, [state(SamplingParams(temperature=0.0, logprobs=20)) for _ in range(8)])
    for i in range(8):
        top = dict(out.top_logprobs[i])
        assert top[int(out.token_ids[i])] == float(out.logprobs[i])  # greedy: the best is in the top


def test_top_logprobs_reach_far_below_the_best_and_break_ties_by_column():
    logits = np.full(3000, -50.0, dtype=np.float32)
    logits[[9, 2000, 5, 700]] = [0.0, -20.0, -20.0, -25.0]
    out = Sampler().sample(logits[None], [state(SamplingParams(logprobs=5))])
    assert [t for t, _ in out.top_logprobs[0]] == [9, 5, 2000, 700, 0]
    np.testing.assert_allclose([v for _, v in out.top_logprobs[0]], log_softmax(logits)[[9, 5, 2000, 700, 0]],
                               atol=1e-5)
