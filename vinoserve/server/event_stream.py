"""Engine outputs -> protocol-neutral events (server/events.py), one place for every API.

`event_stream` merges a request's engine streams (n choices per prompt), counts per-token and
per-request metrics, and runs each choice's text through its `ChoiceText`: `PlainText` passes
text on as it is (completions, chat without tools or reasoning), `ParsedText` splits reasoning off
and reads tool calls from the rest. `collect` accumulates the same events into whole choices for a
non-streamed reply, so a stream always reassembles into exactly the reply it would have been.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from vinoserve.engine.async_engine import RequestStream
from vinoserve.engine.outputs import RequestOutput
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.server.events import (ChoiceResult, Event, Finish, Logprobs, PromptLogprobs, Step, TextDelta,
                                     Usage)
from vinoserve.server.logprobs import output_entries
from vinoserve.server.harmony import HarmonyParser
from vinoserve.server.metrics import Metrics
from vinoserve.server.reasoning import ReasoningParser
from vinoserve.server.tools.format import ToolCallParser


class PlainText:
    """Text as the engine wrote it: one TextDelta per output, empty ones included."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)]

    def finish(self, reason: str | None) -> tuple[list[Event], str | None]:
        return [], reason


class ParsedText:
    """Reasoning split off first (if the model reasons), then tool calls read from the answer."""

    def __init__(self, reasoning: ReasoningParser | HarmonyParser | None, tools: ToolCallParser | HarmonyParser | None,
                 forced: bool) -> None:
        self.reasoning, self.tools, self.forced = reasoning, tools, forced

    def feed(self, text: str) -> list[Event]:
        return self._answer(self.reasoning.feed(text) if self.reasoning else [TextDelta(text)])

    def finish(self, reason: str | None) -> tuple[list[Event], str | None]:
        events = self._answer(self.reasoning.finish()) if self.reasoning else []
        if self.tools is not None:
            events += self.tools.finish()
            # Under auto a call made is finish_reason "tool_calls"; a forced call stays "stop", as OpenAI does.
            if self.tools.made_calls and not self.forced and reason == "stop":
                reason = "tool_calls"
        return events, reason

    def _answer(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if not isinstance(e, TextDelta):
                out.append(e)
            elif self.tools is not None:
                out += self.tools.feed(e.text)
            elif e.text:
                out.append(e)
        return out


ChoiceText = PlainText | ParsedText


async def event_stream(tokenizer: Tokenizer, metrics: Metrics, prompts: list[list[int]], streams: list[RequestStream],
                       choice_text: Callable[[], ChoiceText] = PlainText) -> AsyncIterator[Step | Usage]:
    """One Step per engine output (stream i is choice i, of prompt i // n), then the Usage.
    Leaving early closes every stream, which aborts the unfinished requests."""
    n = len(streams) // len(prompts)
    texts = [choice_text() for _ in streams]
    tokens, cached = [0] * len(streams), [0] * len(streams)
    async for i, out in _merged(metrics, prompts, streams):
        tokens[i], cached[i] = out.num_output_tokens, out.num_cached_tokens
        events: list[Event] = []
        if out.prompt_logprobs is not None:
            events.append(PromptLogprobs(out.prompt_logprobs))
        if out.new_logprobs is not None:
            events.append(Logprobs(output_entries(tokenizer, out)))
        events += texts[i].feed(out.new_text)
        if out.finished:
            more, reason = texts[i].finish(out.finish_reason)
            events += [*more, Finish(reason, out.stop_string)]
        yield Step(i, tuple(events))
    yield Usage(sum(map(len, prompts)), sum(tokens), sum(cached[::n]))


async def collect(steps: AsyncIterator[Step | Usage], count: int) -> tuple[list[ChoiceResult], Usage]:
    """The `count` choices of a stream, whole, and its usage."""
    results = [ChoiceResult(i) for i in range(count)]
    usage = Usage(0, 0)
    async for item in steps:
        if isinstance(item, Usage):
            usage = item
            continue
        for event in item.events:
            results[item.index].add(event)
    return results, usage


async def _merged(metrics: Metrics, prompts: list[list[int]], streams: list[RequestStream]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all streams (n per prompt) as they come, tagged with the stream's index, with
    per-token and per-request metrics. Leaving it early (a client gone, a cancelled task) waits
    for its pumps to stop and closes every stream, which aborts unfinished requests."""
    n = len(streams) // len(prompts)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        last = None
        try:
            async for out in stream:
                t = time.monotonic()
                if last is None and out.new_token_ids and i % n == 0:  # a prompt counts once, when computed
                    metrics.prefilled(len(prompts[i // n]), out.metrics)
                for _ in out.new_token_ids:
                    metrics.token(None if last is None else t - last)
                    last = t
                if out.finished and out.metrics:
                    metrics.finished(out.metrics)
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item.finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Closing a stream a pump is still awaiting would race it; let the pumps unwind first.
        await asyncio.gather(*tasks, return_exceptions=True)
        close_all(streams)


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()
