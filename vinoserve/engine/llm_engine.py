"""The step loop: scheduler -> model runner -> sampler -> outputs."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from vinoserve.cache.block_manager import BlockManager
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.cache.rotation import kernel_supports_rotation
from vinoserve.cache.kv_cache import KVCache, num_blocks_for_bytes
from vinoserve.cache.prefix_cache import salt_hash
from vinoserve.engine.draft_proposer import DraftModelProposer
from vinoserve.engine.evictor import Evictor, SequenceEviction
from vinoserve.memory import available_memory_bytes
from vinoserve.engine.model_runner import ModelRunner, PreparedStep, ScheduledChunk
from vinoserve.engine.outputs import RequestMetrics, RequestOutput
from vinoserve.engine.prompt_logprobs import PromptLogprobs
from vinoserve.engine.speculative import SpeculativeConfig, Speculator
from vinoserve.engine.text_output import TextOutput
from vinoserve.engine.warm_up import warm_up
from vinoserve.model.weights import WeightFormat
from vinoserve.model.loader import LoadedModel, load_model
from vinoserve.model import decode_model
from vinoserve.model.paged import CompileOptions
from vinoserve.scheduler.grammar import GrammarCompiler
from vinoserve.scheduler.sampler import Sampler, SamplingState
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import Scheduler, SchedulerConfig, ScheduledSequence, SchedulerOutput
from vinoserve.scheduler.sequence import Sequence, SequenceStatus

_log = logging.getLogger(__name__)

# Without --kv-cache-size, the cache takes this share of the memory available at start (the
# host's free memory, or what a container's cgroup limit leaves if that is less).
DEFAULT_KV_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the built-in default model
    weight_format: WeightFormat = "auto"
    compile: CompileOptions = field(default_factory=CompileOptions)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_size_gb: float | None = None
    num_kv_blocks: int | None = None  # exact block count, overrides kv_cache_size_gb
    cache_eviction: CacheEvictionConfig | None = None  # None: the whole context stays cached
    host_rotation: bool = False  # rotate evicted-then-moved keys on the host even where the kernel could
    # Reuse computed KV blocks across requests sharing a prefix. Off while cache eviction is on
    # (evicted and rotated blocks no longer match a token prefix); None: on where it can be.
    enable_prefix_caching: bool | None = None
    speculative: SpeculativeConfig | None = None  # None: one token per sequence per step
    # Plan and set up step N+1 while step N computes, so that only sampling stays between two
    # steps. Speculation and cache eviction run one step at a time whatever this says.
    overlap_steps: bool = True

    @property
    def prefix_caching(self) -> bool:
        if self.enable_prefix_caching and self.cache_eviction is not None:
            raise ValueError("prefix caching and cache eviction cannot be used together "
                             "(pass --no-enable-prefix-caching, or drop --cache-eviction)")
        return self.enable_prefix_caching is not False and self.cache_eviction is None

    def compile_options(self) -> CompileOptions:
        """Score outputs when evicting; the kernel's rotation inputs only where it is known to work
        (asked-for f32 compute with an f32/f16 cache): elsewhere the host rotates."""
        ev, c = self.cache_eviction, self.compile
        in_kernel = (ev is not None and ev.rotation and not self.host_rotation
                     and kernel_supports_rotation(c.inference_precision, c.kv_cache_precision))
        return replace(c, score_outputs=ev is not None, cache_rotation=in_kernel)


@dataclass
class StepStats:
    num_steps: int = 0
    step_seconds: float = 0.0  # whole steps: scheduling, packing, infer, sampling, outputs
    overlapped_seconds: float = 0.0  # of which host work done while a step computed (overlapped steps)
    num_generated_tokens: int = 0


@dataclass(eq=False)
class _Launch:
    """A step set up on the runner (and, once started, computing)."""

    plan: SchedulerOutput
    reqs: list[_Request]
    chunks: list[ScheduledChunk]
    prepared: PreparedStep
    waiting_on: list[Sequence]  # whose last input token the step before it is still sampling
    sampling: list[tuple[_Request, int, int]]  # see _sampling_rows (no proposals when overlapped)
    every_row: bool  # the sampling rows are all the logits rows, in order
    computed: list[tuple[Sequence, int]] = field(default_factory=list)  # each one's computed tokens once it ran


@dataclass(eq=False)
class _Request:
    seq: Sequence
    text: TextOutput
    sampling: SamplingState
    metrics: RequestMetrics
    eviction: SequenceEviction | None = None
    prompt_logprobs: PromptLogprobs | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), log=print) -> None:
        self.config = config
        options = config.compile_options()
        self.model: LoadedModel = load_model(config.model, options, config.weight_format, log)
        self.tokenizer = self.model.tokenizer
        paged, layers = self.model.paged, self.model.config.num_layers
        num_blocks = config.num_kv_blocks or self._blocks_from_budget()
        self.cache = KVCache(paged.layout, layers, num_blocks)
        evicting = config.cache_eviction is not None
        salt = salt_hash(config.model, config.weight_format, options, paged.block_size,
                         paged.layout.key_type.get_type_name(), paged.layout.value_type.get_type_name())
        windows = self.model.config.sliding_windows
        # Blocks behind the window are freed only where every layer has one (not Gemma's global layers).
        window = max(windows) if windows and all(windows) and not evicting else 0
        self.blocks = BlockManager(num_blocks, paged.block_size, layers if evicting else 1,
                                   salt if config.prefix_caching else None, window)
        if self.blocks.null_block is not None:
            self.cache.zero_block(self.blocks.null_block)
        self.evictor = None
        if evicting:
            config.cache_eviction.validate(paged.block_size)
            self.evictor = Evictor(config.cache_eviction, self.model.config, self.blocks, self.cache,
                                   in_kernel=options.cache_rotation)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        # Speculation and eviction change a step's inputs after it ran: those run one step at a time.
        self._overlap = config.overlap_steps and config.speculative is None and not evicting
        self.runner = ModelRunner(paged, self.cache, num_requests=2 if self._overlap else 1)
        warm_up(self.runner, num_blocks, paged.block_size, self.model.path / "openvino_model.bin")
        self.sampler = Sampler()
        self.eos_token_ids = tuple(dict.fromkeys([*self.model.config.eos_token_ids, *self.tokenizer.eos_token_ids]))
        spec = config.speculative
        draft = (DraftModelProposer.load(spec, config.compile, self.model, self.eos_token_ids,
                                         num_blocks * paged.block_size, config.scheduler.max_num_batched_tokens, log)
                 if spec is not None and spec.method == "draft_model" else None)
        self.speculator = Speculator(spec, draft) if spec is not None else None
        self.grammars = GrammarCompiler(self.tokenizer.token_bytes, self.model.config.vocab_size, self.eos_token_ids,
                                         sorted(self.tokenizer.special_token_ids),
                                         lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        self._requests: dict[str, _Request] = {}
        self._forks: dict[str, list[_Request]] = {}  # a request id -> choices waiting for its prompt
        self.stats = StepStats()
        self._flight: _Launch | None = None  # the step computing between two calls of step()
        log(f"KV cache: {num_blocks} blocks of {paged.block_size} tokens, {self.cache.nbytes / 2**30:.2f} GiB "
            f"({paged.layout.key_type.get_type_name()} keys, {paged.layout.value_type.get_type_name()} values)"
            + (f"; steps of up to {decode_model.MAX_TOKENS} tokens on the decode model, a second packed copy of "
               f"the weights (about {paged.decode_bytes / 2**30:.2f} GiB; --decode-model off saves it)"
               if paged.decode else ""))

    def _blocks_from_budget(self) -> int:
        paged, layers = self.model.paged, self.model.config.num_layers
        if self.config.kv_cache_size_gb is not None:
            budget = int(self.config.kv_cache_size_gb * 2**30)
        else:
            budget = int(available_memory_bytes() * DEFAULT_KV_MEMORY_FRACTION)
        # More blocks than every sequence at full context could use would be memory for nothing.
        per_seq = -(-self.model.config.max_context // paged.block_size)
        cap = self.config.scheduler.max_num_seqs * per_seq
        blocks = min(num_blocks_for_bytes(budget, paged.layout, layers), cap)
        if blocks < 1:
            raise ValueError(f"a KV cache of {budget} bytes holds no block")
        return blocks

    @property
    def max_context(self) -> int:
        return self.model.config.max_context

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_eviction: dict | None = None,
                    fork_of: str | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. ValueError if it can never run.
        `cache_eviction` overrides the engine's eviction settings for this request. `fork_of`
        names an earlier request with the same prompt (another choice of the same n): this one
        then shares its prompt's KV and samples its first token from the same logits."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        eviction = self.new_eviction(cache_eviction)
        seq = Sequence(request_id, ids, params, block_tables=self.blocks.new_tables())
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        sampling = SamplingState(params, seq.prompt_token_ids, seq.output_token_ids, self.eos_token_ids,
                                 self.grammars.matcher(params.grammar) if params.grammar else None)
        req = _Request(seq, TextOutput(self.tokenizer, params.stop, params.skip_special_tokens), sampling,
                       RequestMetrics(seq.arrival_time), eviction, None if params.prompt_logprobs is None else
                       PromptLogprobs(seq.prompt_token_ids, params.prompt_logprobs))
        self._requests[request_id] = req
        parent = self._requests.get(fork_of) if fork_of is not None else None
        # A choice that scores its prompt computes it itself: a fork would have no prompt logits.
        if (parent is not None and self.evictor is None and not parent.seq.output_token_ids
                and parent.seq.prompt_token_ids == ids and params.prompt_logprobs is None):
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

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
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
        if total > self.max_context:
            raise ValueError(f"this model's maximum context length is {self.max_context} tokens; the prompt "
                             f"has {len(ids)} and max_tokens is {params.max_tokens} ({total} in all)")
        if self.blocks.most_held(total, self.config.scheduler.max_num_batched_tokens) > self.blocks.num_blocks:
            raise ValueError(f"the request needs {total} tokens of KV cache; the cache holds "
                             f"{self.blocks.num_blocks * self.blocks.block_size}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Retire a request now (call between steps); its blocks are freed at once."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for child in self._forks.pop(request_id, []):  # its choices compute the prompt themselves
            self.scheduler.add(child.seq)
        for waiting in self._forks.values():
            if req in waiting:
                waiting.remove(req)
        self.scheduler.finish(req.seq, SequenceStatus.ABORTED, "abort")
        req.metrics.finished_time = time.monotonic()
        return self._output(req, [], "")

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs, decode_tokens = (self._overlapped_step(), 0) if self._overlap else self._step()
        seconds = time.perf_counter() - start
        self.stats.num_steps += 1
        self.stats.step_seconds += seconds
        if decode_tokens:  # the step's own cost, proposals apart
            self.speculator.cost.observe(decode_tokens, seconds - self.speculator.propose_seconds)
        self.stats.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _step(self) -> tuple[list[RequestOutput], int]:
        """This step's outputs, and, when speculating, its token count if every sequence in it was
        decoding (else 0): only those steps price a proposal. Prompt-sized steps steered the fitted
        line until its intercept fell to nothing, which switched speculation off for good."""
        if self.speculator is not None:
            self._propose()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            if (ev := self._requests[seq.request_id].eviction) is not None:
                self.evictor.forget(ev)
        if not plan.scheduled:
            return [], 0
        now = time.monotonic()
        reqs = [self._requests[s.seq.request_id] for s in plan.scheduled]
        chunks = [self._chunk(s, r) for s, r in zip(plan.scheduled, reqs)]
        rotation = self.evictor.kernel_rotation([r.eviction for r in reqs if r.eviction]) if self.evictor else None
        if plan.copies:
            self.cache.copy_blocks(plan.copies)
        result = self.runner.step(chunks, rotation)
        for s, r in zip(plan.scheduled, reqs):
            # Proposals count as computed only once verified (see _sample_and_verify).
            s.seq.num_computed_tokens += s.num_tokens - s.num_drafts
            r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now
        computed = [(s.seq, s.seq.num_computed_tokens) for s in plan.scheduled]
        self.scheduler.cache_computed(computed)
        if any(r.prompt_logprobs is not None for r in reqs):
            self._collect_prompt_logprobs(computed, reqs, chunks, result.logits)
        sampling, _ = _sampling_rows(plan, reqs, chunks)
        outputs = self._sample_and_verify(result.rows, self._fork_choices(sampling, now)) if sampling else []
        if result.scores is not None:  # after verification: the scores of rejected proposals' keys go
            self._collect_scores(chunks, reqs, result.scores)
        for r, _, _ in sampling:
            if r.eviction is not None and not r.seq.status.is_finished:
                self.evictor.evict_if_full(r.seq, r.eviction)
        decoding = self.speculator is not None and all(s.num_tokens == 1 + s.num_drafts for s in plan.scheduled)
        return outputs, plan.num_batched_tokens if decoding else 0

    def _overlapped_step(self) -> list[RequestOutput]:
        """Finishes the step in flight, with the next one planned and set up while it computed
        and started as soon as its tokens are sampled; the outputs are built while the next one
        computes. A sequence that ends (EOS, stop string, abort) was already planned into the next
        step: that work is dropped (its blocks are free again only for steps after it)."""
        if self._flight is None:
            self._flight = self._prepare()
            if self._flight is None:
                return []
            self._launch(self._flight, {})
            self.scheduler.cache_computed(self._flight.computed)
        flight = self._flight
        begin = time.perf_counter()
        # Choices waiting to fork must take the parent's blocks before it moves on: one step at a time.
        ahead = self._prepare() if not self._forks else None
        self.stats.overlapped_seconds += time.perf_counter() - begin
        result = self.runner.wait(flight.prepared)
        if any(r.prompt_logprobs is not None for r in flight.reqs):
            self._collect_prompt_logprobs(flight.computed, flight.reqs, flight.chunks, result.logits)
        live = [x for x in flight.sampling if not x[0].seq.status.is_finished]
        sampling = self._fork_choices(live, time.monotonic())
        # All the rows in order (no copy: 12.6 MB at 64 x 49k) unless a sequence ended or a choice joined.
        rows = result.rows
        if not (flight.every_row and len(sampling) == len(live) == len(flight.sampling)):
            rows = rows[[row for _, row, _ in sampling]]
        reqs = [r for r, _, _ in sampling]
        picks = self._sample(rows, reqs) if sampling else []
        self._flight = ahead
        if ahead is not None:
            tokens = {r.seq: pick[0] for r, pick in zip(reqs, picks) if not isinstance(pick, Exception)}
            self._launch(ahead, tokens)
        begin = time.perf_counter()
        outputs = [self._fail(r, pick) if isinstance(pick, Exception) else self._append_or_fail(r, *pick)
                   for r, pick in zip(reqs, picks)]
        if ahead is not None:
            # Its blocks are shared from now on (a request planned while it computes runs after
            # it); only now are the tokens it was launched with, just appended, all known.
            self.scheduler.cache_computed(ahead.computed)
            self.stats.overlapped_seconds += time.perf_counter() - begin
        return outputs

    def _prepare(self) -> _Launch | None:
        """The next step, planned and set on the runner's idle request (None: nothing to run)."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return None
        reqs = [self._requests[s.seq.request_id] for s in plan.scheduled]
        chunks = [self._chunk(s, r) for s, r in zip(plan.scheduled, reqs)]
        waiting_on = [s.seq for s, c in zip(plan.scheduled, chunks) if c.token_ids[-1] < 0]
        sampling, num_rows = _sampling_rows(plan, reqs, chunks)
        return _Launch(plan, reqs, chunks, self.runner.prepare(chunks), waiting_on, sampling,
                       every_row=len(sampling) == num_rows)

    def _launch(self, launch: _Launch, tokens: dict[Sequence, int]) -> None:
        """Starts a prepared step, its placeholders filled from `tokens` (a sequence that got no
        token has ended; its row computes anything), and books its tokens as computed."""
        if launch.plan.copies:
            self.cache.copy_blocks(launch.plan.copies)
        self.runner.start(launch.prepared, [tokens.get(seq, 0) for seq in launch.waiting_on])
        now = time.monotonic()
        for s, r in zip(launch.plan.scheduled, launch.reqs):
            s.seq.num_computed_tokens += s.num_tokens
            s.seq.num_pending_tokens += s.samples
            launch.computed.append((s.seq, s.seq.num_computed_tokens))
            r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now

    def _propose(self) -> None:
        """Proposals for the decoding sequences that may speculate (set on the sequences)."""
        seqs, room = [], []
        for seq in self.scheduler.running:
            req = self._requests[seq.request_id]
            if seq.is_decoding and req.prompt_logprobs is None:
                seqs.append(seq)
                left = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_context - seq.num_tokens)
                room.append(left if req.eviction is None else min(left, Evictor.room(seq, req.eviction)))
        self.speculator.propose(seqs, room)

    def _sample_and_verify(self, rows: np.ndarray, sampling: list[tuple[_Request, int, int]]) -> list[RequestOutput]:
        """One token per sampling request, then, for those with proposals, one more per proposal
        that equals the token just sampled: position j of every request still verifying is
        sampled in one batch, with the tokens accepted so far already appended."""
        reqs = [r for r, _, _ in sampling]
        first = np.array([row for _, row, _ in sampling])
        outputs: list[RequestOutput | None] = [None] * len(reqs)
        alive, j = list(range(len(reqs))), 0
        while alive:
            idx = first[alive] + j
            batch = _rows(rows, idx)
            picks = self._sample(batch, [reqs[i] for i in alive])
            verifying = []
            for i, pick in zip(alive, picks):
                r, num_drafts = reqs[i], sampling[i][2]
                out = self._fail(r, pick) if isinstance(pick, Exception) else self._append_or_fail(r, *pick)
                outputs[i] = out if outputs[i] is None else outputs[i].merge(out)
                if j < num_drafts and not out.finished and pick[0] == r.seq.draft_token_ids[j]:
                    r.seq.num_computed_tokens += 1  # its KV, written this step, is the right one
                    verifying.append(i)
                elif num_drafts:
                    self.speculator.record(r.seq, num_drafts, j)
                    if not out.finished:
                        self.scheduler.rollback(r.seq)
            alive, j = verifying, j + 1
        return outputs

    def _fork_choices(self, sampling: list[tuple[_Request, int, int]], now: float) -> list[tuple[_Request, int, int]]:
        """Choices waiting for a prompt that just finished join `sampling`, on the prompt's
        blocks and its logits row."""
        if not self._forks:
            return sampling
        joined = list(sampling)
        for parent, row, _ in sampling:
            for child in self._forks.pop(parent.seq.request_id, []):
                self.scheduler.fork(parent.seq, child.seq)
                child.metrics.first_scheduled_time = now
                joined.append((child, row, 0))
        return joined

    def _chunk(self, s: ScheduledSequence, req: _Request) -> ScheduledChunk:
        seq, ev = s.seq, req.eviction
        start = seq.num_computed_tokens
        # Without rotation, kept keys stay at their original positions, so new tokens do too;
        # with it (or without eviction) positions are the compacted cache positions.
        first_position = start if ev is not None and not ev.state.config.rotation else None
        wanted = 1 + s.num_drafts if s.samples else 0
        if req.prompt_logprobs is not None:
            wanted = req.prompt_logprobs.logits_wanted(start, s.num_tokens, s.samples)
        end = start + s.num_tokens - s.num_drafts
        tokens = seq.token_ids(start, end)
        if len(tokens) < end - start:  # its last is being sampled by the step in flight: filled in at launch
            tokens = tokens + [-1]
        if s.num_drafts:
            tokens = tokens + seq.draft_token_ids
        return ScheduledChunk(tokens, seq.num_cached_tokens, seq.block_tables, wanted, first_position,
                              Evictor.score_window(ev, s.samples, s.num_tokens))

    @staticmethod
    def _collect_prompt_logprobs(computed: list[tuple[Sequence, int]], reqs: list[_Request],
                                 chunks: list[ScheduledChunk], logits: list[np.ndarray]) -> None:
        """Hand prompt-scoring chunks' rows to their requests, given each sequence's computed
        tokens once the step ran."""
        for (_, num_computed), r, chunk, rows in zip(computed, reqs, chunks, logits):
            if r.prompt_logprobs is not None:
                r.prompt_logprobs.add(num_computed - len(chunk.token_ids), rows)

    @staticmethod
    def _collect_scores(chunks: list[ScheduledChunk], reqs: list[_Request], scores: list[np.ndarray]) -> None:
        """Each scored chunk's scores of the keys still cached (rejected proposals' are gone)."""
        offset = 0
        for chunk, req in zip(chunks, reqs):
            n = chunk.past_len + len(chunk.token_ids)
            if chunk.score_window and req.eviction is not None and not req.seq.status.is_finished:
                keep = min(n, req.seq.num_cached_tokens)
                req.eviction.state.add([layer[offset:offset + keep] for layer in scores])
            offset += n

    def _sample(self, rows: np.ndarray, reqs: list[_Request]) -> list[tuple[int, float, list | None] | Exception]:
        """One token per request. If the batch raises, each request is sampled alone, so only
        the one whose sampling fails is failed (its seeded neighbours may draw anew this step)."""
        try:
            out = self.sampler.sample(rows, [r.sampling for r in reqs])
            return [(int(out.token_ids[i]), float(out.logprobs[i]), out.top_logprobs[i]) for i in range(len(reqs))]
        except Exception:  # noqa: BLE001 - isolated per request below
            picks: list[tuple[int, float, list | None] | Exception] = []
            for i, r in enumerate(reqs):
                try:
                    out = self.sampler.sample(rows[i:i + 1], [r.sampling])
                    picks.append((int(out.token_ids[0]), float(out.logprobs[0]), out.top_logprobs[0]))
                except Exception as e:  # noqa: BLE001
                    picks.append(e)
            return picks

    def _append_or_fail(self, req: _Request, token: int, logprob: float, top) -> RequestOutput:
        try:
            return self._append(req, token, logprob, top)
        except Exception as e:  # noqa: BLE001 - a fault in one request's output path fails only it
            return self._fail(req, e)

    def _fail(self, req: _Request, error: Exception) -> RequestOutput:
        """Retire a request whose own handling raised; its blocks are freed, the others go on."""
        _log.error("request %s failed: %r", req.seq.request_id, error, exc_info=error)
        if not req.seq.status.is_finished:
            self.scheduler.finish(req.seq, SequenceStatus.ABORTED, "error")
        self._requests.pop(req.seq.request_id, None)
        req.metrics.finished_time = time.monotonic()
        out = self._output(req, [], "")
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _append(self, req: _Request, token: int, logprob: float, top) -> RequestOutput:
        seq, params = req.seq, req.seq.params
        if req.sampling.grammar is not None:  # here, not in the sampler: a batch sampled again after
            req.sampling.grammar.accept(token)  # a fault must not advance a matcher twice
        if seq.num_pending_tokens:  # the token its launch counted in
            seq.num_pending_tokens -= 1
        seq.output_token_ids.append(token)
        req.metrics.first_token_time = req.metrics.first_token_time or time.monotonic()
        reason = None
        if params.ends_at(token, self.eos_token_ids):
            reason, text = "stop", ""
        else:
            text = req.text.add(token)
            if req.text.stopped:
                reason = "stop"
        # check_request keeps prompt + max_tokens within the context, so max_tokens is the only length limit.
        if reason is None and len(seq.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            text += req.text.flush()
            self.scheduler.finish(seq, SequenceStatus.FINISHED, reason)
            req.metrics.finished_time = time.monotonic()
            del self._requests[seq.request_id]
        logprobs = [(logprob, top or [])] if params.logprobs is not None else None
        out = self._output(req, [token], text, logprobs)
        if req.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs.take()
        return out

    def _output(self, req: _Request, tokens: list[int], text: str, logprobs=None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(seq.request_id, seq.prompt_token_ids, tokens, text,
                             finished=seq.status.is_finished, finish_reason=seq.finish_reason,
                             stop_string=req.text.stop_string, num_output_tokens=len(seq.output_token_ids),
                             new_logprobs=logprobs, metrics=req.metrics, num_cached_tokens=seq.num_cached_prompt_tokens)


def _sampling_rows(plan: SchedulerOutput, reqs: list[_Request],
                   chunks: list[ScheduledChunk]) -> tuple[list[tuple[_Request, int, int]], int]:
    """(request, the first logits row it samples, its proposals) for each chunk that samples, and
    the step's number of logits rows. A sampling chunk's rows end with its own row and one per
    proposal; the first of those is sampled first. Python only: in the overlapped loop this runs
    while a step computes, where numpy calls between two steps each cost ~8 us."""
    sampling, end = [], 0
    for s, r, c in zip(plan.scheduled, reqs, chunks):
        end += c.num_logits
        if s.samples:
            sampling.append((r, end - 1 - s.num_drafts, s.num_drafts))
    return sampling, end


def _rows(rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """rows[idx], without the copy (12.6 MB at 64 x 49k) when idx takes every row in order."""
    return rows if len(idx) == len(rows) and (idx == np.arange(len(rows))).all() else rows[idx]
