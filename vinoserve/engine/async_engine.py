"""The engine's step loop in its own thread, behind a message boundary.

Callers (HTTP handlers on the asyncio loop) never touch engine state: they send AddRequest and
Abort messages; the loop thread applies them between steps and sends outputs back onto the
caller's event loop. A consumer that stops iterating (a client disconnect) becomes an Abort.
OpenVINO releases the GIL inside infer(), so the event loop stays responsive during a step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from vinoserve.engine.llm_engine import LLMEngine
from vinoserve.engine.outputs import RequestOutput
from vinoserve.engine.speculative import SpecStats
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.model.vision import VisionModel
from vinoserve.scheduler import media
from vinoserve.scheduler.grammar import GrammarCompiler
from vinoserve.scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """This request's own handling raised; the engine goes on serving the others."""


class EngineDead(RuntimeError):
    """The step loop stopped on an error; no request can run until the process restarts."""


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    cache_eviction: dict | None = None
    fork_of: str | None = None  # an earlier request with this prompt: another choice of the same n
    images: media.Spans = ()


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class EngineSnapshot:
    """Published by the engine thread after each step; replaced whole, so readers see one step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_evicted_blocks: int = 0
    num_rotated_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found cached
    # Tokens sampled for requests whose consumer had already left: the cost of aborting at the
    # next step boundary (about one per disconnect); an abort that never lands makes it grow.
    num_undelivered_tokens: int = 0
    spec_decode: SpecStats | None = None  # a copy; None without speculative decoding


class _Stream:
    """Outputs of one request, handed from the engine thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False  # set by the consumer when it leaves; read by the engine thread

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; nobody is listening
            pass


class RequestStream:
    """One request's outputs as an async iterator. Closing it before the last output aborts the
    request; close() is synchronous and idempotent, so cleanup paths can call it whether or not
    iteration ever started (an async generator that never ran would run no `finally`)."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._stream.closed = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """`on_fatal` is called from the engine thread if the step loop dies."""
        self.engine = engine
        self._on_fatal = on_fatal
        self._inbox: queue.SimpleQueue[AddRequest | Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="vinoserve-engine", daemon=True)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._unapplied = 0  # AddRequests not yet taken from the inbox
        self._undelivered = 0
        self._publish()  # zeros for every counter the engine has, before its first step
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # What request handlers need to know of the model, read-only and safe from any thread.
    @property
    def vision(self) -> VisionModel | None:
        """The model's vision tower and projector, where it takes images (--mmproj)."""
        return self.engine.model.vision

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        """Prompt plus output tokens one sequence may hold (positions the model was trained on)."""
        return self.engine.max_context

    @property
    def context_unbounded(self) -> bool:
        """Eviction with rotation: a request may run past max_context (see LLMEngine)."""
        return self.engine.context_unbounded

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        return self.engine.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence (the model's and its tokenizer's), which min_tokens holds back."""
        return self.engine.eos_token_ids

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles output constraints for this model's vocabulary (thread-safe, cached)."""
        return self.engine.grammars

    def prepare(self, prompt: str | list[int], params: SamplingParams, cache_eviction: dict | None = None,
                images: media.Spans = ()) -> list[int]:
        """Tokenize and validate in the caller's thread, so bad input fails before it is queued."""
        params.validate()
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.check_request(ids, params, self.engine.new_eviction(cache_eviction))
        media.checked_spans(images, len(ids), self.engine.model.image_rules)
        return ids

    @property
    def num_waiting(self) -> int:
        """Requests sent but not yet running: still in the inbox, or in the scheduler's queue."""
        return self._unapplied + self.stats.num_waiting

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
               cache_eviction: dict | None = None, fork_of: str | None = None,
               images: media.Spans = ()) -> RequestStream:
        """Queue a request now (call on the event loop) and return its stream of outputs.
        Submitting is synchronous so that admission control can count it at once."""
        if not self.is_alive:
            raise EngineDead(f"the engine is not running: {self.error}") from self.error
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            self._unapplied += 1
        self._inbox.put(AddRequest(request_id, prompt_token_ids, params, stream, cache_eviction, fork_of,
                                   tuple(images)))
        return RequestStream(self, request_id, stream)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       cache_eviction: dict | None = None, images: media.Spans = ()) -> AsyncIterator[RequestOutput]:
        stream = self.submit(prompt_token_ids, params, request_id, cache_eviction, images=images)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while self._drain_inbox(block=not self.engine.has_unfinished_requests):
                outputs = self.engine.step()
                self._publish()  # before delivering, so a client that saw a token sees the stats behind it
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:  # a fault outside any one request: fail every caller rather than hang them
            log.exception("engine loop died")
            self.error = e
            # The death is reported before callers wake, so whoever sees EngineDead finds it recorded.
            if self._on_fatal is not None:
                self._on_fatal(e)
            for stream in self._streams.values():
                stream.put(EngineDead(f"engine failure: {type(e).__name__}: {e}"))
            self._streams.clear()

    def _publish(self) -> None:
        sched, blocks = self.engine.scheduler, self.engine.blocks
        self.stats = EngineSnapshot(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
            num_preemptions=sched.num_preemptions,
            num_evicted_blocks=ev.num_evicted_blocks if (ev := self.engine.evictor) else 0,
            num_rotated_blocks=ev.num_rotated_blocks if ev else 0,
            prefix_cache_queries=prefix.num_queried_tokens if (prefix := blocks.prefix) else 0,
            prefix_cache_hits=prefix.num_hit_tokens if prefix else 0,
            num_undelivered_tokens=self._undelivered,
            spec_decode=replace(sp.stats, accepted_per_position=list(sp.stats.accepted_per_position))
            if (sp := self.engine.speculator) else None,
        )

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued messages; blocks for the first one when idle. False on shutdown."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is None:
                return False
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif (out := self.engine.abort_request(msg.request_id)) is not None:
                self._deliver(out)
            self._publish()

    def _add(self, msg: AddRequest) -> None:
        with self._lock:
            self._unapplied -= 1
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                    cache_eviction=msg.cache_eviction, fork_of=msg.fork_of, images=msg.images)
        except ValueError as e:
            msg.stream.put(e)
            return
        except Exception as e:  # noqa: BLE001 - a fault in adding one request fails only it
            log.exception("adding request %s failed", msg.request_id)
            self.engine.abort_request(msg.request_id)
            msg.stream.put(RequestFailed(f"{type(e).__name__}: {e}"))
            return
        self._streams[msg.request_id] = msg.stream

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if stream.closed:
            self._undelivered += len(out.new_token_ids)
        stream.put(RequestFailed(out.error) if out.error is not None else out)
