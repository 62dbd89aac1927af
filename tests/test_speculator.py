"""The speculator's parts without a model: prompt lookup, the --speculative-config keys, and the
budget that decides how many proposals a step verifies (from step costs and acceptance odds)."""
from __future__ import annotations

import numpy as np
import pytest

from vinoserve.engine.ngram_proposer import find_continuation
from vinoserve.engine.speculative import AHEAD, SpeculativeConfig, Speculator
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.sequence import Sequence


def _continuation(tokens: list[int], n_min: int = 1, n_max: int = 3, k: int = 4) -> list[int]:
    return find_continuation(np.array(tokens), n_min, n_max, k).tolist()


def test_prompt_lookup_takes_the_longest_then_latest_match():
    assert _continuation([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]) == [9, 2, 3, 7]  # "1 2 3" beats later "2 3"
    assert _continuation([5, 1, 6, 1, 7, 1]) == [7, 1]  # the latest "1"; only what follows it
    assert _continuation([1, 2, 3, 4], n_min=1) == []  # nothing repeats
    assert _continuation([4, 4, 4, 4], k=2) == [4]  # a match ends before the last token
    assert _continuation([1, 2, 8, 2, 9, 1, 2], n_min=2) == [8, 2, 9, 1]
    assert _continuation([1, 2, 8, 2, 9, 1, 2], n_min=2, n_max=2, k=1) == [8]


def test_speculative_config_takes_vllm_keys_and_names_bad_ones():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 3, 2)
    with pytest.raises(ValueError, match="unknown keys.*num_spec_tokens"):
        SpeculativeConfig.parse('{"num_spec_tokens": 4}')
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse('{"method": "eagle"}')
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        SpeculativeConfig.parse('{"num_speculative_tokens": "4"}')
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}')
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse('{"method": "draft_model"}')


def test_proposals_are_made_while_they_pay_for_their_share_of_the_step():
    weight_bound = Speculator(SpeculativeConfig(disable_by_batch_size=64))
    compute_bound = Speculator(SpeculativeConfig(disable_by_batch_size=64))
    for n in (1, 2, 4, 8, 16, 32):
        weight_bound.cost.observe(n, 0.020 + 0.001 * n)  # reading the weights dominates a step
        compute_bound.cost.observe(n, 0.001 + 0.002 * n)
    assert weight_bound.budget([4], [0.9]) == [4]
    assert weight_bound.budget([4, 4], [0.9, 0.04]) == [4, 0]  # one that keeps failing stops
    assert weight_bound.budget([2], [0.9]) == [2]  # near max_tokens
    assert compute_bound.budget([4] * 16, [0.7] * 16) == [0] * 16  # a big batch gains nothing
    assert 0 < sum(compute_bound.budget([4], [0.9])) < 4
    assert Speculator(SpeculativeConfig()).budget([4], [0.9]) == [0]  # nothing measured: no proposals


def test_proposals_keep_a_step_on_the_fast_compilation():
    """With a decode model, steps of up to 16 tokens run on it: proposals fill a step up to that
    size and do not push it past; a step already past it (many sequences) is not capped."""
    spec = Speculator(SpeculativeConfig(disable_by_batch_size=64), fast_step_tokens=16, proposal_cap=16)
    for n in (1, 2, 4, 8, 16, 32):
        spec.cost.observe(n, 0.020 + 0.001 * n)
    assert spec.budget([8], [0.95]) == [8]
    assert sum(spec.budget([8] * 4, [0.95] * 4)) == 12
    assert spec.budget([8] * 2, [0.95, 0.95]) == [7, 7]
    uncapped = Speculator(SpeculativeConfig(disable_by_batch_size=64))
    uncapped.cost = spec.cost
    assert spec.budget([8] * 20, [0.99] * 20) == uncapped.budget([8] * 20, [0.99] * 20) != [0] * 20


def test_speculating_must_beat_the_overlapped_plain_step():
    """A step that verifies proposals runs alone; a plain one hides its host work behind the step
    before. Proposals are made only where the verifying step still yields more tokens per second
    than the overlapped plain one; the next step is planned ahead unless some sequence is likely
    to get one."""
    cheap, dear = Speculator(SpeculativeConfig()), Speculator(SpeculativeConfig())
    for spec, overlapped in ((cheap, 0.022), (dear, 0.012)):
        for n in (1, 2, 3, 5):
            spec.cost.observe(n, 0.020 + 0.004 * n)  # alone: 24 ms at one token
        spec.cost.observe(1, overlapped, overlapped=True)  # the overlap saves 2 ms, or 12
    assert cheap.budget([4], [0.5]) == [2]  # coin-flip proposals pay: 1.75 tokens in 32 ms > 1 in 22
    assert dear.budget([4], [0.5]) == [0]  # not against 1 token in 12 ms
    assert dear.budget([4], [0.95]) == [4]  # a run being copied still does: 4.5 tokens in 40 ms
    spec = dear
    seq = Sequence("s", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=16))
    fresh = Sequence("t", [1, 2, 3, 4], SamplingParams(max_tokens=16))
    assert spec.proposer.may_propose(seq) and not spec.proposer.may_propose(fresh)
    assert spec.plan_ahead([fresh], [16])  # nothing to look up: plan ahead
    assert spec.plan_ahead([seq], [16])  # a match, but at its odds (1/2) not worth the overlap
    spec._acceptance[seq].update(4, 4)
    spec._acceptance[seq].update(4, 4)
    assert not spec.plan_ahead([seq], [16])  # a run being copied: wait for the token, then propose
    assert spec.plan_ahead([seq], [2])  # no room left for a proposal


def test_a_one_token_step_on_its_clone_is_priced_as_timed():
    """Where one-token steps run on a faster compilation that no proposal fits in (the kernel's
    clone), the plain step is priced as timed, not from the line the verifying steps fit: proposals
    must beat the clone's step."""
    clone, plain_line = Speculator(SpeculativeConfig(), fast_step_tokens=1), Speculator(SpeculativeConfig())
    for spec in (clone, plain_line):
        for n, seconds in ((1, 0.010), (2, 0.020), (3, 0.021), (5, 0.023), (9, 0.027)):
            spec.cost.observe(n, seconds)
        spec.cost.observe(1, 0.005, overlapped=True)
    assert sum(plain_line.budget([4], [0.7])) > 0  # the line: a one-token step at 11 ms
    assert clone.budget([4], [0.7]) == [0]  # at 5 ms: 2.8 tokens in 22 ms do not pay
    assert clone.budget([4], [0.95]) == [4]  # 4.5 do


def test_proposals_turned_down_still_teach_a_sequence_its_odds():
    """Prompt lookup's proposals that the budget turns down are kept and scored against the
    tokens the sequence then gets, so its odds move without a verifying step: one that copies its
    context earns its proposals even after every proposal before it failed (without shadows such
    a server never verified again), one that does not loses them; vLLM's counters count only
    what was verified."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    for n in (1, 2, 3, 5):
        spec.cost.observe(n, 0.020 + 0.004 * n)
    spec.cost.observe(1, 0.012, overlapped=True)
    for _ in range(2):  # another sequence's failures do not move these two's odds
        spec.record(Sequence("x", [1, 2], SamplingParams(max_tokens=8)), 4, 0)
    copying = Sequence("c", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=64))
    chatting = Sequence("d", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=64))
    assert spec.plan_ahead([copying], [64]) and spec.plan_ahead([chatting], [64])  # even odds: not worth it
    copying.output_token_ids += [7]  # the lookup said 7 8 9 5
    assert spec.plan_ahead([copying], [64])  # so far so good: nothing settled
    copying.output_token_ids += [8, 9, 5]
    chatting.output_token_ids += [7, 1]
    assert not spec.plan_ahead([copying], [64])  # a run of four copied: it now waits to propose
    assert spec.plan_ahead([chatting], [64])
    assert spec._rate(chatting) < spec._rate(copying)
    assert spec.stats.num_drafts == 2  # the failed ones alone


def test_costs_measured_in_calibration_stay_and_odds_are_a_sequences_own():
    """The calibration plan sets each step's proposals (padded to the planned number where lookup
    finds fewer) and which plain steps are planned ahead; once frozen, no timing moves the costs,
    and a sequence's odds come from its own outcomes alone: the same request takes the same steps."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    seq = Sequence("s", [3, 1, 2, 1, 2], SamplingParams(max_tokens=16))
    spec.calibrate([0, AHEAD, 3])
    spec.propose([seq], [16])
    assert seq.draft_token_ids == [] and spec.plan_ahead([seq], [16])  # then a step planned ahead
    assert not spec.plan_ahead([seq], [16])  # the next one verifies: it waits for its token
    spec.propose([seq], [16])
    assert seq.draft_token_ids == [1, 2, 2] and not spec.calibrating  # "1 2" looked up, padded
    for n in (1, 2, 4, 9):
        spec.cost.observe(n, 0.020 + 0.002 * n)
    spec.record(seq, 3, 3)
    spec.freeze()
    fit, stats = spec.cost.fit(), spec.stats
    spec.cost.observe(1, 0.5)
    spec.cost.observe(3, 0.001)
    assert spec.cost.fit() == fit and stats.num_drafts == 0  # calibration's proposals are not counted
    first, second = (Sequence(r, [1, 2, 3, 1, 2], SamplingParams(max_tokens=16)) for r in "ab")
    odds = spec._rate(first)
    for _ in range(3):
        spec.record(first, 4, 0)
    assert spec._rate(second) == odds > spec._rate(first)
