"""A draft model proposes: a second, smaller paged model (or the same one with lighter weights)
with the target's tokenizer writes k greedy tokens ahead of each speculating sequence.

It keeps its own paged KV cache, block manager and runner. Per sequence it remembers the tokens
whose KV its cache holds, its own earlier proposals included; at each call the part that still
agrees with the sequence's committed tokens stays, the rest is trimmed away, the missing tokens
are computed in one batched catch-up step (chunked to the step budget), and k-1 batched
single-token steps follow. Proposals are the draft's argmax, so they are deterministic, as the
engine's sample-and-compare verification needs."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from vinoserve.cache.block_manager import BlockManager, BlockTables
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.loader import LoadedModel, load_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # whose KV the draft cache holds, in order
    num_agreeing: int = 0  # of those, a prefix known equal to the sequence's committed tokens
    tables: BlockTables = field(default_factory=lambda: [[]])


class DraftModelProposer:
    def __init__(self, draft: LoadedModel, target: LoadedModel, eos_token_ids: Collection[int], num_token_slots: int,
                 max_step_tokens: int) -> None:
        """`eos_token_ids`: the target's, where proposals stop; `num_token_slots`: tokens the draft
        cache holds (rounded down to its blocks); `max_step_tokens`: the most tokens one catch-up
        step computes."""
        if (draft.config.vocab_size != target.config.vocab_size
                or draft.tokenizer.token_bytes != target.tokenizer.token_bytes):
            raise ValueError(f"the draft model {draft.path} does not share the target's tokenizer "
                             f"(vocabularies of {draft.config.vocab_size} and {target.config.vocab_size} tokens, "
                             "or the same size with different tokens): it cannot propose for it")
        paged = draft.paged
        num_blocks = max(1, num_token_slots // paged.block_size)
        self.model = draft
        self.cache = KVCache(paged.layout, draft.config.num_layers, num_blocks)
        self.blocks = BlockManager(num_blocks, paged.block_size)
        self.runner = ModelRunner(paged, self.cache, num_requests=1)  # one step at a time
        self.max_step_tokens = max(1, max_step_tokens)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._states: dict[Sequence, _DraftState] = {}

    @classmethod
    def load(cls, config: SpeculativeConfig, options: CompileOptions, target: LoadedModel,
             eos_token_ids: Collection[int], num_token_slots: int, max_step_tokens: int, log=print) -> DraftModelProposer:
        """The draft named by config.model, compiled like the target, weights as config.weight_format."""
        draft = load_model(config.model, options, config.weight_format, log)
        proposer = cls(draft, target, eos_token_ids, num_token_slots, max_step_tokens)
        log(f"draft model {draft.path.name}: KV cache of {proposer.blocks.num_blocks} blocks, "
            f"{proposer.cache.nbytes / 2**30:.2f} GiB")
        return proposer

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_blocks - self.blocks.num_free_blocks

    def drop_finished(self) -> None:
        """Free the draft KV of sequences that finished, were aborted or preempted."""
        for seq in [s for s, st in self._states.items() if s.status.is_finished or s.status is SequenceStatus.PREEMPTED]:
            self.blocks.free(self._states.pop(seq).tables)

    def may_propose(self, seq: Sequence) -> bool:
        return True  # a draft model always has a guess

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self.drop_finished()
        proposals: list[list[int]] = [[] for _ in seqs]
        todo: dict[int, list[int]] = {}  # seq index -> committed tokens the draft cache lacks
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k > 0 and (missing := self._catch_up_tokens(seq, k)) is not None:
                todo[i] = missing
        last = self._catch_up(seqs, todo)
        for i, token in last.items():
            proposals[i].append(token)
        # One token per step for each sequence that still wants more and has not proposed a stop.
        alive = [i for i in last if ks[i] > 1 and not seqs[i].params.ends_at(last[i], self.eos_token_ids)]
        while alive:
            chunks = [ScheduledChunk([proposals[i][-1]], len(self._states[seqs[i]].tokens),
                                     self._states[seqs[i]].tables, prompt=False) for i in alive]
            picks = self._greedy(self.runner.step(chunks).rows)
            for i, token in zip(alive, picks):
                self._states[seqs[i]].tokens.append(proposals[i][-1])
                proposals[i].append(token)
            alive = [i for i in alive
                     if len(proposals[i]) < ks[i] and not seqs[i].params.ends_at(proposals[i][-1], self.eos_token_ids)]
        for i in last:  # blocks reserved for proposals that were not made (a stop) go back
            st = self._states[seqs[i]]
            self.blocks.trim(st.tables, len(st.tokens))
        return proposals

    def _catch_up_tokens(self, seq: Sequence, k: int) -> list[int] | None:
        """Roll the draft cache of seq back to what agrees with its committed tokens and reserve
        blocks for the rest and k-1 proposals; returns the tokens to compute (at least the last
        committed one, whose logits give the first proposal), or None when there is no room."""
        st = self._states.setdefault(seq, _DraftState())
        total = seq.num_tokens
        if total + k - 1 > self.model.config.max_context:
            return None
        agree = st.num_agreeing
        # Committed tokens only grow, so only the draft's own unverified tail needs comparing.
        for token in seq.token_ids(agree, min(len(st.tokens), total)):
            if token != st.tokens[agree]:
                break
            agree += 1
        agree = min(agree, total - 1)
        del st.tokens[agree:]
        st.num_agreeing = agree
        self.blocks.trim(st.tables, agree)
        if not self.blocks.can_grow(st.tables, total + k - 1):
            return None  # the draft cache is full: this sequence decodes plainly this step
        self.blocks.grow(st.tables, total + k - 1)
        return seq.token_ids(agree, total)

    def _catch_up(self, seqs: list[Sequence], todo: dict[int, list[int]]) -> dict[int, int]:
        """Compute the missing tokens of every sequence in todo, in steps of at most
        max_step_tokens tokens; returns each one's greedy next token."""
        first: dict[int, int] = {}
        while todo:
            chunks, owners, budget = [], [], self.max_step_tokens
            for i, missing in todo.items():
                if budget == 0:
                    break
                st, take = self._states[seqs[i]], missing[:budget]
                chunks.append(ScheduledChunk(take, len(st.tokens), st.tables, int(len(take) == len(missing)),
                                             prompt=len(st.tokens) < len(seqs[i].prompt_token_ids)))
                owners.append(i)
                budget -= len(take)
            rows = self.runner.step(chunks).rows
            picks = iter(self._greedy(rows) if len(rows) else [])
            for i, chunk in zip(owners, chunks):
                st = self._states[seqs[i]]
                st.tokens += chunk.token_ids
                st.num_agreeing = len(st.tokens)
                del todo[i][:len(chunk.token_ids)]
                if chunk.num_logits:
                    first[i] = next(picks)
                    del todo[i]
        return first

    @staticmethod
    def _greedy(rows: np.ndarray) -> list[int]:
        return np.argmax(rows, axis=1).tolist()
