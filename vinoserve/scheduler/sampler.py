"""Turns a batch of next-token logits into tokens: penalties, masking, temperature, top-k/p, min-p.

Every step is a numpy array op over the rows that need it, so rows left at the defaults cost
next to nothing. Each random row takes exactly one uniform from its own generator per step
and its token depends on nothing else in the batch, so a seed reproduces a sequence whatever
it is batched with.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from vinoserve.scheduler.grammar import FORBIDDEN, GrammarState, apply_grammar_masks
from vinoserve.scheduler.penalties import TokenTally, penalise
from vinoserve.scheduler.sampling_params import SamplingParams

_BLOCK = 1024  # columns per first-level block of the inverse CDF
_SLICE = 1 << 20  # logits drawn from at once (rows of them): a slice's passes stay in cache
# How far below its best a row looks for its k best or its nucleus, in logits (over the
# temperature), in turn while what is there falls short; the last takes every token. The 50th
# best of a real row lies a median 8 T below its best, 13 T at the 90th percentile: a step to 12
# spares those rows sorting the ~2,300 tokens within 16 T.
_GAPS = (8.0, 12.0, 16.0, 32.0, np.inf)


def make_rng(seed: int | None) -> np.random.Generator:
    """A generator from `seed`, or from fresh OS entropy when it is None."""
    # SeedSequence takes non-negative ints only, while the OpenAI API allows any integer.
    return np.random.default_rng(None if seed is None else seed % 2**64)


@dataclass(eq=False)  # one per live sequence, compared by identity
class SamplingState:
    """What the sampler needs of one sequence; the token lists are only read."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarState | None = None  # the structured-output constraint; its owner advances it
    rng: np.random.Generator = field(init=False, repr=False)
    tally: TokenTally | None = field(default=None, init=False, repr=False)  # kept by the penalties
    _uniform: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = make_rng(self.params.seed)

    def uniform(self) -> float:
        """This step's uniform. It stays this step's until a sample() returns with it, so a
        batch that raised, sampled again request by request, draws every seeded row as it would
        have been drawn undisturbed."""
        if self._uniform is None:
            self._uniform = self.rng.random()
        return self._uniform

    def used_uniform(self) -> None:
        self._uniform = None


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # [N] int64
    logprobs: np.ndarray  # [N] float32: the chosen token's raw log_softmax; NaN unless asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # the k best (id, logprob) of the raw logits


class Sampler:
    def sample(self, logits: np.ndarray, rows: Sequence[SamplingState]) -> SamplerOutput:
        """Samples one token per row of `logits` [N, V] for the N sequences in `rows`."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {logits.shape} do not match {len(rows)} rows")
        work = _constrain(penalise(logits, rows), logits, rows)
        params = [r.params for r in rows]
        if all(p.is_greedy for p in params):  # the common batch: skip building the filters' arrays
            tokens = work.argmax(axis=1)
            _require_sampleable(_best_of(work, range(len(rows)), tokens))
            return _with_logprobs(logits, tokens, rows)
        vocab = work.shape[1]
        greedy = np.array([p.is_greedy for p in params], dtype=bool)
        top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
        top_p = np.array([p.top_p for p in params])
        # Drawn before top_k=1 rows are routed to argmax, so that every random row takes one
        # uniform per step whatever its filters.
        u = np.array([0.0 if g else r.uniform() for r, g in zip(rows, greedy)])
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        min_p = np.array([p.min_p for p in params])

        tokens = np.empty(len(rows), dtype=np.int64)
        # top_k=1 keeps only the argmax, and argmax breaks ties exactly as greedy does.
        sel = np.flatnonzero(greedy | (top_k == 1))
        if len(sel):
            tokens[sel] = (work if len(sel) == len(rows) else work[sel]).argmax(axis=1)
            _require_sampleable(_best_of(work, sel.tolist(), tokens[sel]))
        sel = np.flatnonzero(~greedy & (top_k != 1))
        if len(sel):
            x = work if len(sel) == len(rows) else work[sel]
            args = (temperature[sel], min_p[sel], top_k[sel], top_p[sel], u[sel])
            step = max(1, _SLICE // x.shape[1])  # 64 x 152k at once: 16 ms; in slices of 6 rows: 11
            for i in range(0, len(sel), step):
                tokens[sel[i:i + step]] = _draw(x[i:i + step], *(a[i:i + step] for a in args))
        out = _with_logprobs(logits, tokens, rows)
        for r in rows:
            r.used_uniform()
        return out


def _weights(logits: np.ndarray, peak: np.ndarray, temperature: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """exp((logits - peak) / temperature) for rows of [n, V] whose largest logit is `peak`, so
    each row's best token weighs 1, with weights under min_p dropped to 0."""
    # Subtracting the max before dividing keeps small temperatures from losing the
    # differences between the top logits to float32 rounding.
    w = np.subtract(logits, peak[:, None])  # a new array: `logits` may be the raw ones logprobs read
    if (temperature != 1).any():  # temperature 1 is the OpenAI default: a pass over V spared
        w /= temperature[:, None]
    np.exp(w, out=w)
    if min_p.any():
        w[w < min_p[:, None]] = 0.0  # the best weighs 1, so min_p * best is min_p
    return w


def _best_of(work: np.ndarray, rows: Sequence[int], tokens: np.ndarray) -> list[float]:
    """work[rows, tokens] by scalar reads: on the greedy path, right after infer() has flushed
    the caches, numpy's fancy indexing took 75 us of a single stream's step, these 25."""
    return [work.item(r, t) for r, t in zip(rows, tokens.tolist())]


def _require_sampleable(best: list[float]) -> None:
    """Raises for a batch with a row whose best logit is NaN (argmax and max both return NaN for
    a row holding one) or -inf (every token excluded; no API input does that now: logit_bias is
    bounded, grammar masks are finite, min_tokens yields to a complete grammar): nothing can be
    drawn from it. The engine then samples each request alone and fails only that one. (+inf is
    a token made certain, by a repetition_penalty near 0 for one: argmax takes it, and so does
    _draw.)"""
    bad = next((b for b in best if math.isnan(b) or b == -math.inf), None)
    if bad is not None:
        raise ValueError("no token can be sampled: " + ("the model's logits are NaN" if math.isnan(bad) else
                         "every token is excluded (every logit is -inf)"))


def _constrain(work: np.ndarray, logits: np.ndarray, rows: Sequence[SamplingState]) -> np.ndarray:
    """`work` after logit_bias, grammar masks and min_tokens; copied first if it is still the raw
    logits, which logprobs report unconstrained."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    guided = [i for i, r in enumerate(rows) if r.grammar is not None]
    early = [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
    if not (biased or guided or early):
        return work
    if work is logits:
        work = logits.copy()
    for i in biased:
        ids, bias = zip(*rows[i].params.logit_bias)
        work[i, list(ids)] += np.array(bias, dtype=np.float32)
    if guided:
        apply_grammar_masks(work, guided, [rows[i].grammar for i in guided])
    for i in early:
        _hold_back_stops(work[i], rows[i])
    return work


def _hold_back_stops(row: np.ndarray, state: SamplingState) -> None:
    """min_tokens: the stop tokens out of reach, unless the row's grammar allows nothing else (a
    complete JSON value, say). The output must stay valid, so there the grammar wins; holding the
    stops back as well left only forbidden tokens to pick from."""
    stops = list(state.eos_token_ids + state.params.stop_token_ids)
    held = row[stops]
    row[stops] = -np.inf
    if state.grammar is not None and row.max() <= FORBIDDEN:
        row[stops] = held


def _top_sorted(values: np.ndarray, peak: np.ndarray, k: int) -> np.ndarray:
    """Indices [n, k] of each row's k largest values (k <= W), largest first, ties in column order;
    `peak` is each row's largest."""
    n = len(values)
    best = np.empty((n, k), dtype=np.int64)
    for rows, row, col, value in _near_best(values, peak, np.ones(n, dtype=np.float32),
                                            lambda todo, row, value: value,
                                            lambda todo, row, value: np.bincount(row, minlength=len(todo)) >= k):
        order = _by_row_descending(row, value)
        row, col = row[order], col[order]
        best[rows] = col[_rank_in_row(row, len(rows)) < k].reshape(-1, k)
    return best


def _near_best(values: np.ndarray, peak: np.ndarray, scale: np.ndarray,
               weigh: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
               enough: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]):
    """Each row's entries within gap * scale of its largest, `peak`, at the first gap of _GAPS
    where enough(todo, row, weight) holds of them, with weight = weigh(todo, row, value) (`row`
    indexes `todo`, the rows still looking). A row's k best or its nucleus are nearly always a
    few dozen entries, so rows rarely look past the first gap: ranking a whole 49k-token row
    took 0.4 ms. Yields, gap by gap: the batch rows done there, and their entries as (row, an
    index into those rows, ascending; column; weight)."""
    n, width = values.shape
    todo = np.arange(n)
    for gap in _GAPS:
        sub = values if len(todo) == n else values[todo]
        flat = np.flatnonzero(sub >= (peak[todo] - gap * scale[todo])[:, None])  # by row, then column
        row, col = np.divmod(flat, width)
        weight = weigh(todo, row, sub.ravel()[flat])
        done = enough(todo, row, weight) | (gap == np.inf)
        if done.any():
            keep = done[row]
            yield todo[done], (np.cumsum(done) - 1)[row[keep]], col[keep], weight[keep]
        todo = todo[~done]
        if not len(todo):
            return


def _by_row_descending(row: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The order that sorts (row, value) pairs by row, then by value descending, ties kept in
    their given order: one stable sort of an int64 key with the row above the float32 value's
    bits, flipped so that they order as the values do (np.lexsort took 5x as long)."""
    bits = values.astype(np.float32, copy=False).view(np.int32).astype(np.int64)
    ascending = np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # negative floats order backwards
    return np.argsort((row.astype(np.int64) << 32) | (0x7FFFFFFF - ascending), kind="stable")


def _row_starts(row: np.ndarray, n: int) -> np.ndarray:
    """Where each of rows 0..n-1 starts in `row`, sorted ascending."""
    return np.searchsorted(row, np.arange(n))


def _rank_in_row(row: np.ndarray, n: int) -> np.ndarray:
    """Each entry's place among its row's entries, for `row` sorted ascending over rows 0..n-1."""
    return np.arange(len(row)) - _row_starts(row, n)[row]


def _draw(logits: np.ndarray, temperature: np.ndarray, min_p: np.ndarray, top_k: np.ndarray,
          top_p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One token per row of logits [n, V] at uniform u, after min_p, top_k (0: off), top_p.

    A row without top_k needs every token's weight, to draw from or as top_p's whole; a top_k
    row only its k best's. And a row's k best, or its nucleus, are nearly always a few dozen
    tokens far above the rest: so a filtered row ranks only those near its best (_near_best),
    looking lower only while they fall short (fewer than k, or less than top_p of the row's
    weight). Ranking each row's whole vocabulary cost 40-60 ms a step at 64 x 49k."""
    n = len(logits)
    peak = logits.max(axis=1)  # a slice's first pass: it brings the slice into cache for the rest
    _require_sampleable(peak.tolist())
    tokens = np.empty(n, dtype=np.int64)
    certain = np.isposinf(peak)
    if certain.any():  # the draw's limit as a logit grows: that token (the first of equals, as argmax)
        tokens[certain] = logits[certain].argmax(axis=1)
    total = np.zeros(n)
    full = np.flatnonzero((top_k == 0) & ~certain)
    if len(full):
        w = _weights(logits if len(full) == n else logits[full], peak[full], temperature[full], min_p[full])
        plain = top_p[full] >= 1
        if plain.any():
            tokens[full[plain]] = _pick(w if plain.all() else w[plain], u[full[plain]])
        if not plain.all():
            total[full[~plain]] = (w if not plain.any() else w[~plain]).sum(axis=1)
    sel = np.flatnonzero(((top_k > 0) | (top_p < 1)) & ~certain)
    if not len(sel):
        return tokens
    x = logits if len(sel) == n else logits[sel]
    peak, temperature, min_p, top_k, top_p, total = (a[sel] for a in (peak, temperature, min_p, top_k, top_p, total))

    def weigh(todo: np.ndarray, row: np.ndarray, logit: np.ndarray) -> np.ndarray:
        weight = np.exp((logit - peak[todo][row]) / temperature[todo][row])
        weight[weight < min_p[todo][row]] = 0.0
        return weight

    def enough(todo: np.ndarray, row: np.ndarray, weight: np.ndarray) -> np.ndarray:
        count = np.bincount(row, minlength=len(todo))
        mass = np.bincount(row, weights=weight, minlength=len(todo))
        return np.where(top_k[todo] > 0, count >= top_k[todo], mass >= top_p[todo] * total[todo])

    for rows, row, col, weight in _near_best(x, peak, temperature, weigh, enough):
        tokens[sel[rows]] = _draw_candidates(row, col, weight, top_k[rows], top_p[rows], total[rows], u[sel[rows]])
    return tokens


def _draw_candidates(row: np.ndarray, col: np.ndarray, weight: np.ndarray, top_k: np.ndarray,
                     top_p: np.ndarray, total: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Tokens from candidates given as (row, col, weight), rows ascending, each row holding its
    top_k (0: off) best and, with top_p, tokens enough to reach top_p of `total`."""
    n = len(top_k)
    # By row, then heaviest first, ties in column order.
    order = _by_row_descending(row, weight)
    row, col, weight = row[order], col[order], weight[order]
    rank = _rank_in_row(row, n)
    keep = (top_k[row] == 0) | (rank < top_k[row])
    row, col, weight = row[keep], col[keep], weight[keep]
    # A token stays while the weight strictly before it is below top_p of the row's: the
    # smallest prefix that reaches top_p. min_p went first, so top_p sees what it left, as in
    # vLLM v1; a top_k row's whole is its k best.
    whole = np.where(top_k > 0, np.bincount(row, weights=weight, minlength=n), total)
    before = np.cumsum(weight, dtype=np.float64) - weight
    before -= before[_row_starts(row, n)][row]
    keep = before < (top_p * whole)[row]
    row, col, weight = row[keep], col[keep], weight[keep]
    # Each row's kept tokens, padded with zero weights to the widest, go through the inverse CDF.
    count = np.bincount(row, minlength=n)
    place = _rank_in_row(row, n)
    p = np.zeros((n, count.max()), dtype=np.float32)
    ids = np.zeros((n, count.max()), dtype=np.int64)
    p[row, place], ids[row, place] = weight, col
    return ids[np.arange(n), _pick(p, u)]


def _pick(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Column where each row's CDF over weights p [n, W] first exceeds u * total.

    Block sums, then a cumsum inside one block: a float64 cumsum over all W is ~15x slower.
    The block sums stay float32 (numpy sums them pairwise): casting all of p to float64 cost
    more than the rest of the draw, for mass under float32's own resolution.
    """
    n, width = p.shape
    if width <= _BLOCK:  # one float64 cumsum: its last entry is the total, so u < 1 stops inside the row
        cum = np.cumsum(p, axis=1, dtype=np.float64)
        return (cum <= (u * cum[:, -1])[:, None]).sum(axis=1)
    size = _BLOCK
    sums = np.add.reduceat(p, np.arange(0, width, size), axis=1)
    cum = np.cumsum(sums, axis=1, dtype=np.float64)
    target = u * cum[:, -1]  # u < 1, so some block passes it, and that block has mass
    rows = np.arange(n)
    b = (cum <= target[:, None]).sum(axis=1)
    cols = b[:, None] * size + np.arange(size)
    block = np.where(cols < width, p[rows[:, None], np.minimum(cols, width - 1)], 0.0)  # the last may be short
    rest = np.maximum(target - np.where(b > 0, cum[rows, b - 1], 0.0), 0.0)
    # The first column past rest >= 0 has weight; rounding between the two levels may carry
    # rest past the whole block, and then its last weighted column is the pick.
    col = (np.cumsum(block, axis=1, dtype=np.float64) <= rest[:, None]).sum(axis=1)
    last = size - 1 - (block[:, ::-1] > 0).argmax(axis=1)
    return b * size + np.minimum(col, last)


def _log_sum_exp(row: np.ndarray, peak: np.float32) -> float:
    return float(peak + np.log(np.exp(row - peak).sum(dtype=np.float64)))


@lru_cache(maxsize=8)
def _unasked(n: int) -> np.ndarray:
    """n NaN logprobs, read-only and shared: between two steps even np.full costs ~8 us."""
    nan = np.full(n, np.nan, dtype=np.float32)
    nan.flags.writeable = False
    return nan


def _with_logprobs(logits: np.ndarray, tokens: np.ndarray, rows: Sequence[SamplingState]) -> SamplerOutput:
    # Only rows that asked pay for the log-softmax: an exp over V costs more than a greedy step.
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    chosen = _unasked(len(rows))
    if not asked:
        return SamplerOutput(tokens, chosen, top)
    asked, chosen = np.array(asked, dtype=np.int64), chosen.copy()
    x = logits if len(asked) == len(rows) else logits[asked]
    peak = x.max(axis=1)  # one pass, for the log-sum-exp and the top logprobs' search
    # Row by row: one row's exp stays in cache for its sum (the whole batch at once took 2x as long).
    lse = np.array([_log_sum_exp(row, p) for row, p in zip(x, peak)])
    chosen[asked] = x[np.arange(len(asked)), tokens[asked]] - lse
    ks = [rows[i].params.logprobs for i in asked]
    best = _top_sorted(x, peak, min(max(ks), x.shape[1])) if max(ks) else None
    for j, (i, k) in enumerate(zip(asked, ks)):
        # Rounded as the chosen token's is, so a token reports one logprob wherever it appears.
        top[i] = [(int(t), float(np.float32(x[j, t] - lse[j]))) for t in best[j, :k]] if k else []
    return SamplerOutput(tokens, chosen, top)
