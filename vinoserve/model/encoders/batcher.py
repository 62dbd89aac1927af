"""Concurrent encoder requests packed into ragged batches on one thread of their own.

Requests queue from the event loop; the thread takes everything waiting (up to a token budget),
sorts the sequences by length so each padded attention row wastes little, runs them in as few
graph calls as the budget allows, and hands each request its rows. One request's 500 documents
and forty 8-token queries arriving together become a handful of calls, not 540.

Beside a chat model the cores are shared: the chat engine keeps its next step computing while it
samples the last (overlapped steps), so there is no gap between its steps for encoder work to
take turns in, and an encoder running flat out beside it slowed decoding 2-3x on 2 cores
(benchmarks: `vinoserve bench embed --beside-chat`). So while `chat_busy()` says the chat model is
decoding, the encoder computes in slices of about SLICE_S and rests between them, busy at most
`share` of the time; alone, it runs at full speed.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vinoserve.model.encoders.model import EncoderModel
from vinoserve.model.encoders.packing import Sequence

log = logging.getLogger(__name__)

# Padded tokens (rows x longest) per graph call: big enough that matmuls run at full speed, small
# enough that attention's [B, heads, L, L] scores stay in the tens of MB.
MAX_BATCH_TOKENS = 8192
SLICE_S = 0.02  # one graph call's length while the chat model decodes: short next to a decode step


@dataclass
class _Job:
    seqs: list[Sequence]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EncoderBatcher:
    def __init__(self, model: EncoderModel, max_batch_tokens: int = MAX_BATCH_TOKENS, name: str = "encoder",
                 chat_busy: Callable[[], bool] = lambda: False, share: float = 1.0) -> None:
        self.model, self.max_batch_tokens = model, max_batch_tokens
        self.chat_busy, self.share = chat_busy, share
        self._seconds_per_token = 0.0  # measured: what SLICE_S buys
        self._queue: deque[_Job] = deque()
        self._ready = threading.Condition()
        self._stopped = False
        self.batches = 0  # graph calls made, for tests and metrics
        self._thread = threading.Thread(target=self._run, name=f"vinoserve-{name}", daemon=True)
        self._thread.start()

    async def run(self, seqs: list[Sequence]) -> np.ndarray:
        """The model's rows for `seqs` (pooled vectors or logits), batched with whatever else waits."""
        if not seqs:
            return np.zeros((0, 0), np.float32)
        loop = asyncio.get_running_loop()
        job = _Job(seqs, loop, loop.create_future())
        with self._ready:
            if self._stopped:
                raise RuntimeError("the encoder is shut down")
            self._queue.append(job)
            self._ready.notify()
        return await job.future

    def shutdown(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout=10)

    def _take(self) -> list[_Job] | None:
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            jobs = [self._queue.popleft()]
            tokens = sum(len(s.ids) for s in jobs[0].seqs)
            while self._queue and tokens + (n := sum(len(s.ids) for s in self._queue[0].seqs)) <= self.max_batch_tokens:
                jobs.append(self._queue.popleft())
                tokens += n
            return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                results = self._compute([s for job in jobs for s in job.seqs])
            except Exception as e:  # a fault of ours: these requests fail, the next ones still run
                log.error("encoder batch failed", exc_info=e)
                for job in jobs:
                    job.loop.call_soon_threadsafe(_settle, job.future, None, e)
                continue
            start = 0
            for job in jobs:
                rows = results[start:start + len(job.seqs)]
                start += len(job.seqs)
                job.loop.call_soon_threadsafe(_settle, job.future, rows, None)

    def _compute(self, seqs: list[Sequence]) -> np.ndarray:
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
        out: list[np.ndarray | None] = [None] * len(seqs)
        while order:
            sharing = self.share < 1.0 and self.chat_busy()
            budget = self.max_batch_tokens
            if sharing and self._seconds_per_token:
                budget = max(1, min(budget, int(SLICE_S / self._seconds_per_token)))
            # sorted ascending, so the newest member is the longest: rows x it is the padded size
            n = 1
            while n < len(order) and (n + 1) * len(seqs[order[n]].ids) <= budget:
                n += 1
            chunk, order = order[:n], order[n:]
            start = time.perf_counter()
            rows = self.model.run([seqs[j] for j in chunk])
            elapsed = time.perf_counter() - start
            self.batches += 1
            for j, row in zip(chunk, rows):
                out[j] = row
            padded = n * len(seqs[chunk[-1]].ids)
            self._seconds_per_token = elapsed / padded if not self._seconds_per_token else (
                0.8 * self._seconds_per_token + 0.2 * elapsed / padded)
            if sharing:
                time.sleep(elapsed * (1 - self.share) / self.share)
        return np.stack(out)


def _settle(future: asyncio.Future, rows: np.ndarray | None, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(rows)
