"""The step loop: scheduler -> model runner -> sampler -> outputs."""
from __future__ import annotations

import logging
import time

import numpy as np

from vinoserve.cache.block_manager import BlockManager, blocks_held
from vinoserve.cache.kv_cache import KVCache
from vinoserve.cache.layer_groups import LayerGroups
from vinoserve.cache.prefix_cache import salt_hash
from vinoserve.engine import step_plan
from vinoserve.engine.calibration import calibrate
from vinoserve.engine.config import EngineConfig, StepStats
from vinoserve.engine.draft_proposer import DraftModelProposer
from vinoserve.engine.evictor import Evictor, SequenceEviction
from vinoserve.engine.model_runner import ModelRunner
from vinoserve.engine.outputs import RequestMetrics, RequestOutput
from vinoserve.engine.prompt_logprobs import PromptLogprobs
from vinoserve.engine.request_state import Pick, RequestState, sample
from vinoserve.engine.speculative import Speculator
from vinoserve.engine.step_plan import Launch, SamplingRow
from vinoserve.engine.text_output import TextOutput
from vinoserve.engine.warm_up import warm_up
from vinoserve.memory import release_freed_heap
from vinoserve.model.cpu_class import this_cpu
from vinoserve.model.loader import LoadedModel, load_model
from vinoserve.model.mapped_pages import drop_mapped_pages
from vinoserve.scheduler import media
from vinoserve.scheduler.grammar import GrammarCompiler
from vinoserve.scheduler.sampler import Sampler, SamplingState
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import Scheduler
from vinoserve.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["EngineConfig", "LLMEngine"]

_log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), log=print) -> None:
        self.config = config
        options = config.compile_options()
        self.model: LoadedModel = load_model(config.model, options, config.weight_format, log, config.projector)
        self.tokenizer = self.model.tokenizer
        paged, layers = self.model.paged, self.model.config.num_layers
        evicting = config.cache_eviction is not None
        salt = salt_hash(config.model, config.weight_format, options, paged.block_size, paged.layout.key_type.get_type_name(),
                         paged.layout.value_type.get_type_name()) if config.prefix_caching else None
        self.groups = LayerGroups.of(() if evicting else self.model.config.sliding_windows, layers)
        if self.groups.hybrid and not config.window_sized_caches:
            self.groups = LayerGroups.of((), layers)  # every layer keeps every block (a 'before' to measure)
        pooled = self.groups.windows if self.groups.hybrid else self.groups.windows[:1]  # tables of one pool
        num_blocks = config.num_blocks(paged.layout, self.groups.num_slots, blocks_held(
            pooled, paged.block_size, self.model.config.max_context, config.scheduler.max_num_batched_tokens))
        self.blocks = BlockManager(num_blocks, paged.block_size, layers if evicting else 1, salt,
                                   self.groups.windows[0], self.groups.windows if self.groups.hybrid else ())
        self.cache = KVCache(paged.layout, layers, num_blocks, self.groups.slot_of)
        if self.blocks.null_block is not None:
            self.cache.zero_block(self.blocks.null_block)
        self.evictor = None
        if evicting:
            config.cache_eviction.validate(paged.block_size)
            self.evictor = Evictor(config.cache_eviction, self.model.config, self.blocks, self.cache,
                                   options.cache_rotation, config.scheduler.max_num_batched_tokens)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        # Eviction changes a step's inputs after it ran: it runs one step at a time. Speculation
        # does only in the steps that verify proposals (see Speculator.plan_ahead).
        self._overlap = config.overlap_steps and not evicting
        self.runner = ModelRunner(paged, self.cache, num_requests=2 if self._overlap else 1,
                                  table_of=self.groups.table_of if self.groups.hybrid else None)
        warm_up(self.runner, num_blocks, paged.block_size)
        self.sampler = Sampler()
        self.eos_token_ids = tuple(dict.fromkeys([*self.model.config.eos_token_ids, *self.tokenizer.eos_token_ids]))
        spec = config.speculative
        draft = (DraftModelProposer.load(spec, config.compile, self.model, self.eos_token_ids,
                                         num_blocks * paged.block_size, config.scheduler.max_num_batched_tokens, log)
                 if spec is not None and spec.method == "draft_model" else None)
        self.speculator = Speculator(spec, draft, paged.decode_tokens, paged.proposal_cap) if spec is not None else None
        self.grammars = GrammarCompiler(self.tokenizer.token_bytes, self.model.config.vocab_size, self.eos_token_ids,
                                         sorted(self.tokenizer.special_token_ids),
                                         lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        self._requests: dict[str, RequestState] = {}
        self._forks: dict[str, list[RequestState]] = {}  # a request id -> choices waiting for its prompt
        self.stats = StepStats()
        self._flight: Launch | None = None  # the step computing between two calls of step()
        log(f"KV cache: {num_blocks} blocks of {paged.block_size} tokens, {self.cache.nbytes / 2**30:.2f} GiB "
            f"({paged.layout.key_type.get_type_name()} keys, {paged.layout.value_type.get_type_name()} values)"
            + (f"; {paged.describe()}" if paged.describe() else "")
            + (f"; defaults for CPU class {this_cpu().value}" if options.device == "CPU" else ""))
        if self.speculator is not None:
            calibrate(self, log)
        drop_mapped_pages(*self.model.weight_files)  # the plugin packed its own copy by now
        release_freed_heap()  # the load's temporaries (see memory.py)

    @property
    def max_context(self) -> int:
        return self.model.config.max_context

    @property
    def context_unbounded(self) -> bool:
        """Requests with the server's settings may run past max_context: eviction with rotation
        keeps their positions inside it."""
        return self.evictor is not None and self.evictor.rebases(self.evictor.config)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_eviction: dict | None = None,
                    fork_of: str | None = None, images: media.Spans = ()) -> list[int]:
        """Queue a request; returns its prompt token ids. ValueError if it can never run.
        `cache_eviction` overrides the engine's eviction settings for this request. `fork_of`
        names an earlier request with the same prompt (another choice of the same n): this one
        then shares its prompt's KV and samples its first token from the same logits. `images`: rows
        in place of token embeddings at their prompt positions (EngineConfig.image_inputs)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        eviction = self.new_eviction(cache_eviction)
        self.check_request(ids, params, eviction)
        spans = media.checked_spans(images, len(ids), self.model.image_rules)
        seq = Sequence(request_id, ids, params, time.monotonic() if arrival_time is None else arrival_time,
                       block_tables=self.blocks.new_tables(), images=spans)
        if eviction is not None and eviction.state.config.during_prefill:
            seq.most_blocks = self._most_held(len(ids), params.max_tokens, eviction)
        sampling = SamplingState(params, seq.prompt_token_ids, seq.output_token_ids, self.eos_token_ids,
                                 self.grammars.matcher(params.grammar) if params.grammar else None)
        req = RequestState(seq, TextOutput(self.tokenizer, params.stop, params.skip_special_tokens), sampling,
                           RequestMetrics(seq.arrival_time), eviction, None if params.prompt_logprobs is None else
                           PromptLogprobs(seq.prompt_token_ids, params.prompt_logprobs))
        self._requests[request_id] = req
        parent = self._requests.get(fork_of) if fork_of is not None else None
        # A choice that scores its prompt computes it itself: a fork would have no prompt logits.
        if (parent is not None and self.evictor is None and not parent.seq.output_token_ids
                and parent.seq.same_prompt(ids, spans) and params.prompt_logprobs is None):
            self._forks.setdefault(fork_of, []).append(req)
        else:  # nothing to fork from (any more): computed on its own, from the prefix cache where it can
            self.scheduler.add(seq)
        return ids

    def new_eviction(self, overrides: dict | None) -> SequenceEviction | None:
        """Validated per-request eviction state; ValueError for overrides this engine cannot honour."""
        if self.evictor is None:
            if overrides:
                raise ValueError("cache_eviction: this server runs without cache eviction "
                                 "(start it with --cache-eviction START,RECENT,MAX)")
            return None
        return self.evictor.new_sequence(overrides)

    def check_request(self, ids: list[int], params: SamplingParams, eviction: SequenceEviction | None = None) -> None:
        """ValueError naming the problem if this request could never run; reads only fixed config."""
        if not ids:
            raise ValueError("the prompt is empty")
        if params.n != 1:  # each choice is its own request, forked from the first (see add_request)
            raise ValueError("n: the engine runs one choice per request; LLM.generate and the server fan n out")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        total = len(ids) + params.max_tokens
        within = total  # positions the sequence takes before anything can rebase them
        if eviction is not None and self.evictor.rebases(eviction.state.config):
            # evicting with rotation, positions rebase before they leave the context: from the
            # first prompt chunk on with during_prefill, else once the prompt is in
            within = 0 if eviction.state.config.during_prefill else len(ids)
        if within > self.max_context:
            raise ValueError(f"this model's maximum context length is {self.max_context} tokens; the prompt "
                             f"has {len(ids)} and max_tokens is {params.max_tokens} ({total} in all)")
        held = self._most_held(len(ids), params.max_tokens, eviction)
        if held > self.blocks.num_blocks:
            raise ValueError(f"the request needs {total} tokens of KV cache, {held} blocks of "
                             f"{self.blocks.block_size}; the cache holds {self.blocks.num_blocks}")

    def _most_held(self, prompt_len: int, max_tokens: int, eviction: SequenceEviction | None) -> int:
        """Blocks a request holds at most at once."""
        step = self.config.scheduler.max_num_batched_tokens
        held = self.blocks.most_held(prompt_len + max_tokens, step)
        if eviction is not None:
            # evicted back to the budget (and the block being filled) after every step: from the
            # first prompt chunk on with during_prefill, else once the prompt is in
            bound = eviction.state.config.max_cache_size + self.blocks.block_size - 1 + step
            if not eviction.state.config.during_prefill:
                bound = max(bound, prompt_len + step)
            held = min(held, self.blocks.blocks_for(bound))
        return held

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Retire a request now (call between steps); its blocks are freed at once."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for child in self._forks.pop(request_id, []):  # its choices compute the prompt themselves
            self.scheduler.add(child.seq)
        for waiting in self._forks.values():
            if req in waiting:
                waiting.remove(req)
        self._retire(req, SequenceStatus.ABORTED, "abort")
        return req.output([], "")

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """One step in three phases: prepare (propose, schedule, set the inputs on the runner),
        launch (start it, book its tokens as computed) and finish (wait, sample, append, then
        speculation's verification and eviction). One step at a time, finish follows launch at
        once. Overlapped, the next step is prepared while this one computes and launched as soon
        as this one's tokens are sampled; this one's outputs are built while that one computes."""
        start = time.perf_counter()
        flight = self._flight
        overlapped = flight is not None  # planned ahead, while the step before it computed
        if flight is None and (flight := self._prepare()) is not None:
            self._launch(flight, {})
            self.scheduler.cache_computed(flight.computed)
        outputs = self._finish(flight) if flight is not None else []
        seconds = time.perf_counter() - start
        self.stats.num_steps += 1
        self.stats.step_seconds += seconds
        # Only steps of decoding sequences price a proposal: prompt-sized steps steered the fitted
        # line until its intercept fell to nothing, which switched speculation off for good.
        if self.speculator is not None and flight is not None and (tokens := flight.decode_tokens):
            proposing = 0.0 if overlapped else self.speculator.propose_seconds  # planned ahead: no proposals
            self.speculator.cost.observe(tokens, seconds - proposing, overlapped)
        self.stats.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _prepare(self, ahead: bool = False) -> Launch | None:
        """The next step, planned and set on the runner's idle request (None: nothing to run).
        Planned `ahead` of the step computing, it has no proposals: their last token is unknown."""
        if self.speculator is not None:
            seqs, room = self._speculating()
            if ahead:
                for seq in seqs:
                    seq.draft_token_ids = []
            else:
                self.speculator.propose(seqs, room)
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            if (ev := self._requests[seq.request_id].eviction) is not None:
                self.evictor.forget(ev)
        if not plan.scheduled:
            return None
        reqs = [self._requests[s.seq.request_id] for s in plan.scheduled]
        chunks = [step_plan.chunk(s, r) for s, r in zip(plan.scheduled, reqs)]
        rotation = self.evictor.kernel_rotation([r.eviction for r in reqs if r.eviction]) if self.evictor else None
        waiting_on = [s.seq for s, c in zip(plan.scheduled, chunks) if c.token_ids[-1] < 0]
        sampling, num_rows = step_plan.sampling_rows(plan, reqs, chunks)
        return Launch(plan, reqs, chunks, self.runner.prepare(chunks, rotation), waiting_on, sampling,
                      every_row=len(sampling) == num_rows)

    def _launch(self, launch: Launch, tokens: dict[Sequence, int]) -> None:
        """Starts a prepared step, its placeholders filled from `tokens` (a sequence that got no
        token has ended; its row computes anything). The one place a step's sequences count its
        tokens: computed (proposals only once verified, in _append_picks), and the token it
        samples as pending until it is appended."""
        if launch.plan.copies:
            self.cache.copy_blocks(launch.plan.copies)
        self.runner.start(launch.prepared, [tokens.get(seq, 0) for seq in launch.waiting_on])
        now = time.monotonic()
        for s, r in zip(launch.plan.scheduled, launch.reqs):
            s.seq.num_computed_tokens += s.num_tokens - s.num_drafts
            s.seq.num_pending_tokens += s.samples
            launch.computed.append((s.seq, s.seq.num_computed_tokens))
            r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now

    def _finish(self, flight: Launch) -> list[RequestOutput]:
        """Waits for the step in flight and turns its logits into outputs. A sequence that ended
        (EOS, stop string, abort) after it was planned into this step is skipped: its row
        computed nothing of use."""
        ahead = None
        # Choices waiting to fork must take the parent's blocks before it moves on: one step at a time.
        # A step verifying proposals adds an unknown number of tokens: the next waits for them.
        if self._overlap and not self._forks and (self.speculator is None or (
                not any(x.num_drafts for x in flight.sampling) and self.speculator.plan_ahead(*self._speculating()))):
            begin = time.perf_counter()
            ahead = self._prepare(ahead=True)
            self.stats.overlapped_seconds += time.perf_counter() - begin
        result = self.runner.wait(flight.prepared)
        if any(r.prompt_logprobs is not None for r in flight.reqs):
            for (_, num_computed), r, c, rows in zip(flight.computed, flight.reqs, flight.chunks, result.logits):
                if r.prompt_logprobs is not None:
                    r.prompt_logprobs.add(num_computed - len(c.token_ids), rows)
        live = [x for x in flight.sampling if not x.req.seq.status.is_finished]
        sampling = self._fork_choices(live, time.monotonic())
        # All the rows in order (no copy: 12.6 MB at 64 x 49k) unless a sequence ended or a choice joined.
        rows = result.rows
        if not (flight.every_row and len(sampling) == len(flight.sampling)):
            rows = rows[[x.row for x in sampling]]
        reqs = [r for r, _, _ in sampling]
        picks = sample(self.sampler, rows, reqs) if sampling else []
        self._flight = ahead
        if ahead is not None:
            self._launch(ahead, {r.seq: p.token for r, p in zip(reqs, picks) if not isinstance(p, Exception)})
        begin = time.perf_counter()
        outputs = self._append_picks(result.rows, sampling, picks)
        if ahead is not None:
            # Its blocks are shared from now on (a request planned while it computes runs after
            # it); only now are the tokens it was launched with, just appended, all known.
            self.scheduler.cache_computed(ahead.computed)
            self.stats.overlapped_seconds += time.perf_counter() - begin
        if self.evictor is not None:
            self._evict(flight, result.scores)
        return outputs

    def _speculating(self) -> tuple[list[Sequence], list[int]]:
        """The decoding sequences that may speculate, and how many tokens each may still add."""
        seqs, room = [], []
        for seq in self.scheduler.running:
            req = self._requests[seq.request_id]
            if seq.is_decoding and req.prompt_logprobs is None:
                seqs.append(seq)
                left = seq.params.max_tokens - len(seq.output_token_ids)
                if req.eviction is None:
                    room.append(min(left, self.max_context - seq.num_tokens))
                else:  # eviction keeps its positions inside the context (or the request fits in it)
                    room.append(min(left, Evictor.room(seq, req.eviction)))
        return seqs, room

    def _append_picks(self, rows: np.ndarray, sampling: list[SamplingRow],
                      picks: list[Pick | Exception]) -> list[RequestOutput]:
        """Appends each request's pick; then, for those with proposals, samples and appends one
        more per proposal that equals the token just appended: position j of every request still
        verifying is sampled in one batch, with the tokens accepted so far already appended."""
        outputs: list[RequestOutput | None] = [None] * len(sampling)
        alive, j = range(len(sampling)), 0
        while True:
            verifying = []
            for i, pick in zip(alive, picks):
                r, num_drafts = sampling[i].req, sampling[i].num_drafts
                out = self._append_or_fail(r, pick)
                outputs[i] = out if outputs[i] is None else outputs[i].merge(out)
                if j < num_drafts and not out.finished and pick.token == r.seq.draft_token_ids[j]:
                    r.seq.num_computed_tokens += 1  # its KV, written this step, is the right one
                    verifying.append(i)
                elif num_drafts:
                    self.speculator.record(r.seq, num_drafts, j)
                    if not out.finished:
                        self.scheduler.rollback(r.seq)
            if not verifying:
                return outputs
            alive, j = verifying, j + 1
            picks = sample(self.sampler, rows[[sampling[i].row + j for i in alive]], [sampling[i].req for i in alive])

    def _evict(self, step: Launch, scores: list[np.ndarray]) -> None:
        """After verification (the scores of rejected proposals' keys go): each scored chunk's
        scores of the keys still cached, then eviction where its cache is over the budget. A
        chunk is scored where it samples, and with during_prefill every prompt chunk too."""
        offset = 0
        for c, r in zip(step.chunks, step.reqs):
            n = c.past_len + len(c.token_ids)
            if c.score_window and r.eviction is not None and not r.seq.status.is_finished:
                keep = min(n, r.seq.num_cached_tokens)
                r.eviction.state.add([layer[offset:offset + keep] for layer in scores], c.score_window)
                self.evictor.evict_if_full(r.seq, r.eviction)
            offset += n

    def _fork_choices(self, sampling: list[SamplingRow], now: float) -> list[SamplingRow]:
        """Choices waiting for a prompt that just finished join `sampling`, on the prompt's
        blocks and its logits row."""
        if not self._forks:
            return sampling
        joined = list(sampling)
        for parent, row, _ in sampling:
            for child in self._forks.pop(parent.seq.request_id, []):
                self.scheduler.fork(parent.seq, child.seq)
                child.metrics.first_scheduled_time = now
                joined.append(SamplingRow(child, row, 0))
        return joined

    def _append_or_fail(self, req: RequestState, pick: Pick | Exception) -> RequestOutput:
        if isinstance(pick, Exception):
            return self._fail(req, pick)
        try:
            text, reason = req.append(pick, self.eos_token_ids)
            if reason is not None:
                self._retire(req, SequenceStatus.FINISHED, reason)
            return req.output([pick.token], text, pick)
        except Exception as e:  # noqa: BLE001 - a fault in one request's output path fails only it
            return self._fail(req, e)

    def _fail(self, req: RequestState, error: Exception) -> RequestOutput:
        """Retire a request whose own handling raised; its blocks are freed, the others go on."""
        _log.error("request %s failed: %r", req.seq.request_id, error, exc_info=error)
        self._retire(req, SequenceStatus.ABORTED, "error")
        out = req.output([], "")
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _retire(self, req: RequestState, status: SequenceStatus, reason: str) -> None:
        if not req.seq.status.is_finished:
            self.scheduler.finish(req.seq, status, reason)
        self._requests.pop(req.seq.request_id, None)
        req.metrics.finished_time = time.monotonic()
