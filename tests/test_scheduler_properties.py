"""Allocator and scheduler invariants under random arrivals, aborts and budgets (no model needed:
the test plays the model by advancing computed tokens and appending a token to finished chunks)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vinoserve.cache.block_allocator import BlockAllocator, OutOfBlocks
from vinoserve.cache.block_manager import BlockManager
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import Scheduler, SchedulerConfig
from vinoserve.scheduler.sequence import Sequence, SequenceStatus

BLOCK = 4


@given(st.lists(st.one_of(st.just("alloc"), st.integers(0, 15)), max_size=200))
def test_allocator_never_double_allocates_or_leaks(ops):
    alloc = BlockAllocator(8)
    held: list[int] = []
    for op in ops:
        if op == "alloc":
            if alloc.num_free == 0:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate()
            else:
                block = alloc.allocate()
                assert block not in held
                held.append(block)
        elif held:
            alloc.free(held.pop(op % len(held)))
        assert alloc.num_free + len(held) == 8
    for block in held:
        alloc.free(block)
    assert alloc.num_free == 8
    with pytest.raises(ValueError, match="double free"):
        alloc.free(0)


def _check_invariants(sched: Scheduler, blocks: BlockManager, live: list[Sequence], budget: int) -> None:
    tables = [b for s in live for b in s.block_tables[0] if b != blocks.null_block]
    assert len(tables) == len(set(tables)), "a block is in two tables"
    assert len(tables) + blocks.num_free_blocks == blocks.num_blocks, "blocks leaked"
    for s in live:
        table = s.block_tables[0]
        assert len(table) >= blocks.blocks_for(s.num_computed_tokens)
        released = [i for i, b in enumerate(table) if b == blocks.null_block]
        assert all(i < blocks.behind(s.num_computed_tokens) for i in released), "a block in the window was freed"
        assert len(table) - len(released) <= blocks.most_held(s.num_tokens, budget)
        if s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            assert s.block_tables[0] == [] and s.num_computed_tokens == 0


requests = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(1, 12)),  # arrival step, prompt, max_tokens
    min_size=1, max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(6, 40), st.integers(1, 6), st.integers(1, 48),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 11)), max_size=4), st.sampled_from([0, 1, 5, 9]))
def test_scheduler_invariants(reqs, num_blocks, max_seqs, budget, aborts, window):
    """`window`: every layer's attention window (blocks behind it are released), 0 for none."""
    blocks = BlockManager(num_blocks, BLOCK, window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), blocks)
    seqs = [Sequence(f"r{i}", list(range(p)), SamplingParams(max_tokens=m)) for i, (_, p, m) in enumerate(reqs)]
    # Requests that could never fit are rejected at the door by the engine; mirror that here.
    fits = [blocks.most_held(p + m, budget) <= blocks.num_blocks for _, p, m in reqs]
    live: list[Sequence] = []
    for step in range(400):
        arrive_and_abort(step, sched, seqs, [arrival for arrival, *_ in reqs], fits, aborts, live)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        if live and not sched.running and not out.scheduled:
            pytest.fail("livelock: work is waiting but nothing was scheduled")
        for s in out.scheduled:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_tokens
            assert len(s.seq.block_tables[0]) >= blocks.blocks_for(s.seq.num_computed_tokens)
            if samples:
                s.seq.output_token_ids.append(7)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, SequenceStatus.FINISHED, "length")
                    live.remove(s.seq)
        _check_invariants(sched, blocks, live, budget)
        if step > max(a for a, _, _ in reqs) and not live:
            break
    assert not live, "requests never finished"
    assert blocks.num_free_blocks == blocks.num_blocks
    for s, ok in zip(seqs, fits):
        if ok and s.finish_reason == "length":
            assert len(s.output_token_ids) == s.params.max_tokens


def test_preemption_takes_the_newest_and_requeues_it_first():
    blocks = BlockManager(4, BLOCK)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0), blocks)
    old, new = (Sequence(n, list(range(8)), SamplingParams(max_tokens=8)) for n in ("old", "new"))
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [old, new] and blocks.num_free_blocks == 0
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        s.seq.output_token_ids.append(1)
    out = sched.schedule()  # old needs a third block: new gives its two back
    assert [s.seq for s in out.scheduled] == [old] and out.preempted == [new]
    assert new.status is SequenceStatus.PREEMPTED and new.block_tables == [[]] and sched.waiting[0] is new
    assert sched.num_preemptions == 1


@pytest.mark.parametrize("window", [0, 2 * BLOCK])
def test_blocks_behind_a_window_are_looked_for_only_where_there_is_one(window, monkeypatch):
    """release_behind ran for every sequence every step, windows or not (0.3-0.4 us each)."""
    calls = []
    monkeypatch.setattr(BlockManager, "release_behind", lambda self, tables, first: calls.append(first))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0),
                      BlockManager(16, BLOCK, window=window))
    seqs = [Sequence(n, list(range(8)), SamplingParams(max_tokens=8)) for n in ("a", "b")]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):
        for s in sched.schedule().scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            s.seq.output_token_ids.append(1)
    assert calls == ([] if not window else [8, 8, 9, 9])  # running sequences, from the second step


def arrive_and_abort(step: int, sched: Scheduler, seqs: list[Sequence], arrivals: list[int], fits: list[bool],
                     aborts: list[tuple[int, int]], live: list[Sequence]) -> None:
    """This step's arrivals join the scheduler and `live`; this step's aborts leave both."""
    for i, arrival in enumerate(arrivals):
        if arrival == step and fits[i]:
            sched.add(seqs[i])
            live.append(seqs[i])
    for at, idx in aborts:
        if at == step and idx < len(seqs) and seqs[idx] in live:
            sched.finish(seqs[idx], SequenceStatus.ABORTED, "abort")
            live.remove(seqs[idx])
