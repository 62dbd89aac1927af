"""Prefix-cache invariants under random shared prefixes, forks (n choices), arrivals, aborts and
preemption (no model:
the test plays the model and writes each token's id into a fake KV block, so a block written
while shared, or a hit on the wrong content, shows up as a content mismatch)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vinoserve.cache.block_allocator import BlockAllocator
from vinoserve.cache.block_manager import BlockManager
from vinoserve.cache.prefix_cache import PrefixCache
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import MIN_PROMPT_CHUNK, Scheduler, SchedulerConfig
from vinoserve.scheduler.sequence import Sequence, SequenceStatus
from test_scheduler_properties import arrive_and_abort

BLOCK = 4
BASE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]


def _check(blocks: BlockManager, live: list[Sequence], kv: dict[int, list]) -> None:
    alloc, prefix = blocks.allocators[0], blocks.prefix
    in_tables: dict[int, int] = {}
    for s in live:
        for b in s.block_tables[0]:
            if b != blocks.null_block:
                in_tables[b] = in_tables.get(b, 0) + 1
    for b in range(blocks.num_blocks):
        assert alloc.ref_count(b) == in_tables.get(b, 0), f"block {b}: ref count vs tables"
    assert blocks.num_free_blocks == blocks.num_blocks - len(in_tables), "a block is both free and in a table"
    for b in range(blocks.num_blocks):
        tokens = prefix.entry_tokens(b)
        if tokens is not None:
            assert tuple(kv[b]) == tokens, f"cached block {b} holds other tokens than its hash says"
    for s in live:
        table = s.block_tables[0]
        for i in range(s.num_computed_tokens // BLOCK):
            if table[i] == blocks.null_block:  # released: behind every query's window
                assert i < blocks.behind(s.num_computed_tokens)
            else:
                assert kv[table[i]] == s.token_ids(i * BLOCK, (i + 1) * BLOCK), "a sequence reads KV not its own"
        if s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            assert table == [] and s.num_computed_tokens == 0


requests = st.lists(
    # arrival step, shared-prefix length, own suffix length, max_tokens
    st.tuples(st.integers(0, 20), st.integers(0, 24), st.integers(0, 9), st.integers(1, 10)),
    min_size=1, max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(6, 30), st.integers(1, 6), st.integers(1, 40),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=3), st.integers(0, 2),
       st.sampled_from([0, 1, 6, 9]))
def test_prefix_cache_invariants(reqs, num_blocks, max_seqs, budget, aborts, forks, window):
    """`window`: every layer's attention window (blocks behind it are released), 0 for none."""
    blocks = BlockManager(num_blocks, BLOCK, prefix_salt=b"test", window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), blocks)
    seqs = [Sequence(f"r{i}", BASE[:shared] + [100 + i] * own or [1], SamplingParams(max_tokens=m))
            for i, (_, shared, own, m) in enumerate(reqs)]
    fits = [blocks.most_held(len(s.prompt_token_ids) + s.params.max_tokens, budget) <= blocks.num_blocks for s in seqs]
    kv: dict[int, list] = {b: [None] * BLOCK for b in range(num_blocks)}
    live: list[Sequence] = []
    for step in range(500):
        arrive_and_abort(step, sched, seqs, [arrival for arrival, *_ in reqs], fits, aborts, live)
        out = sched.schedule()
        for src, dst in out.copies:  # copy-on-write of a shared, partly filled block
            kv[dst] = list(kv[src])
        assert out.num_batched_tokens <= budget
        if live and not sched.running and not out.scheduled:
            pytest.fail("livelock: work is waiting but nothing was scheduled")
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            for pos in range(start, start + s.num_tokens):
                block = seq.block_tables[0][pos // BLOCK]
                assert block != blocks.null_block, "writing into a released block"
                assert blocks.allocators[0].ref_count(block) == 1, "writing into a shared block"
                kv[block][pos % BLOCK] = seq.token_ids(pos, pos + 1)[0]
            seq.num_computed_tokens += s.num_tokens
        sched.cache_computed([(s.seq, s.seq.num_computed_tokens) for s in out.scheduled])
        for s in out.scheduled:
            if s.samples and not s.seq.output_token_ids and s.seq.request_id.count("/") == 0:
                for k in range(forks):  # n choices: siblings start on this prompt's blocks
                    child = Sequence(f"{s.seq.request_id}/{k}", s.seq.prompt_token_ids, s.seq.params)
                    sched.fork(s.seq, child)
                    child.output_token_ids.append(60 + k)
                    live.append(child)
            if s.samples:
                s.seq.output_token_ids.append(50 + len(s.seq.output_token_ids) % 3)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, SequenceStatus.FINISHED, "length")
                    live.remove(s.seq)
        _check(blocks, live, kv)
        if step > max(r[0] for r in reqs) and not live:
            break
    assert not live, "requests never finished"
    assert blocks.num_free_blocks == blocks.num_blocks, "a block did not come back"
    prefix = blocks.prefix
    assert prefix.num_hit_tokens <= prefix.num_queried_tokens


def test_hit_needs_matching_tokens_and_leaves_the_last_token():
    alloc = BlockAllocator(8)
    cache = PrefixCache(alloc, BLOCK, b"salt")
    tokens = list(range(12))
    get = lambda a, b: tokens[a:b]  # noqa: E731
    hashes = cache.extend_hashes([], get, 3)
    table = [alloc.allocate() for _ in range(3)]
    for i, b in enumerate(table):
        cache.register(b, i, hashes, get)
    # 12 tokens: blocks 0 and 1 at most, so token 11 is computed and has logits.
    hits = [(b,) for b in table]  # one group: a block each
    assert cache.match([], get, 12) == hits[:2]
    assert cache.match([], get, 13) == hits
    other = tokens[:5] + [99] + tokens[6:]
    assert cache.match([], lambda a, b: other[a:b], 12) == hits[:1]
    # A different salt (another model or cache precision) never hits.
    assert PrefixCache(BlockAllocator(8), BLOCK, b"other").match([], get, 12) == []
    # Freed cached blocks stay hit-able until memory is needed, oldest first.
    for b in reversed(table):
        alloc.free(b)
    assert alloc.num_free == 8 and cache.match([], get, 13) == hits
    fresh = [alloc.allocate() for _ in range(5)]
    assert not set(fresh) & set(table)
    alloc.allocate()  # the least recently freed cached block: the last one, freed first
    assert cache.match([], get, 13) == hits[:2]


def test_a_prefix_shared_by_simultaneous_arrivals_is_computed_once():
    blocks = BlockManager(32, BLOCK, prefix_salt=b"test")
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, watermark=0), blocks)
    prefix = BASE[:12]  # three blocks
    seqs = [Sequence(f"r{i}", prefix + [100 + i, 101 + i, 102 + i, 103 + i], SamplingParams(max_tokens=1))
            for i in range(3)]
    for s in seqs:
        sched.add(s)
    computed = 0
    while sched.has_unfinished:
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            computed += s.num_tokens
        sched.cache_computed([(s.seq, s.seq.num_computed_tokens) for s in out.scheduled])
        for s in out.scheduled:
            if s.samples:
                s.seq.output_token_ids.append(1)
                sched.finish(s.seq, SequenceStatus.FINISHED, "length")
    assert computed == 16 + 2 * 4, "the 12 shared tokens once, then each request's own 4"
    assert [s.num_cached_prompt_tokens for s in seqs] == [0, 12, 12]
    assert blocks.prefix.num_queried_tokens == 3 * 16 and blocks.prefix.num_hit_tokens == 24
    assert blocks.num_free_blocks == 32


def test_a_prompts_last_tokens_are_computed_in_a_chunk_of_at_least_the_least_size():
    """A prompt's last few tokens, computed alone, take other kernels than in a long chunk: a hit
    leaves at least MIN_PROMPT_CHUNK tokens to compute (a cached block goes unused for it), and
    the step budget cuts a prompt at a block's end that leaves as many for its last chunk."""
    least = MIN_PROMPT_CHUNK
    blocks = BlockManager(64, BLOCK, prefix_salt=b"test")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4 * least), blocks)
    prompt = [7 + i % 50 for i in range(4 * least + 2)]  # two tokens past the budget
    chunks = _run_alone(sched, Sequence("a", prompt, SamplingParams(max_tokens=1)))
    assert chunks == [len(prompt) - least - 2, least + 2]  # cut at a block's end, as a hit would be
    hit = Sequence("b", prompt, SamplingParams(max_tokens=1))
    assert _run_alone(sched, hit) == [least + 2] and hit.num_cached_prompt_tokens == len(prompt) - least - 2
    longer = Sequence("c", prompt + [99] * (least + 1), SamplingParams(max_tokens=1))
    assert _run_alone(sched, longer) == [least + 3]  # every block of the prompt above is a hit


def test_requests_that_give_up_a_cached_block_for_the_least_chunk_are_admitted_together():
    """Same-prompt requests whose tail past the cached blocks is under MIN_PROMPT_CHUNK each
    compute the last cached block again; none waits for another to compute it (it is cached
    already), so all are admitted in one step, not one a step."""
    least = MIN_PROMPT_CHUNK
    blocks = BlockManager(64, BLOCK, prefix_salt=b"test")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16 * least), blocks)
    prompt = [7 + i % 50 for i in range(2 * least + 2)]  # two tokens past a block's end
    _run_alone(sched, Sequence("first", prompt, SamplingParams(max_tokens=1)))
    for i in range(4):
        sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert [s.num_tokens for s in out.scheduled] == [least + 2] * 4


def _run_alone(sched: Scheduler, seq: Sequence) -> list[int]:
    """The chunks in which `seq`, alone, computes its prompt."""
    sched.add(seq)
    chunks = []
    while sched.has_unfinished:
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            chunks.append(s.num_tokens)
        sched.cache_computed([(s.seq, s.seq.num_computed_tokens) for s in out.scheduled])
        if out.scheduled[-1].samples:
            sched.finish(seq, SequenceStatus.FINISHED, "length")
    return chunks
