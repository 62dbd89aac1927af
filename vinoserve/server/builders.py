"""Driving a reply builder (responses/render.py, anthropic/render.py) over the event stream: a
builder takes the protocol-neutral events once and gives its API's streamed events for each
(`start`, `step`, `done`, `failed`), accumulating the whole reply as it goes. A stream yields those
events; a whole reply runs the same builder and drops them, so the two always agree."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from vinoserve.server.events import Step, Usage

E = TypeVar("E", covariant=True)


class Builder(Protocol[E]):
    def start(self) -> list[E]: ...

    def step(self, step: Step) -> list[E]: ...

    def done(self, usage: Usage) -> list[E]: ...

    def failed(self, error: Exception) -> list[E]: ...


async def streamed(builder: Builder[E], events: AsyncIterator[Step | Usage]) -> AsyncIterator[E]:
    """The builder's events; a failure after the first is the builder's failure event, ending
    the stream (its status line is sent)."""
    for event in builder.start():
        yield event
    try:
        async for item in events:
            for event in (builder.done(item) if isinstance(item, Usage) else builder.step(item)):
                yield event
    except Exception as e:  # noqa: BLE001 - reported in the stream, as the API words it
        for event in builder.failed(e):
            yield event


async def built(builder: Builder, events: AsyncIterator[Step | Usage]) -> None:
    """Runs the builder to the end for a whole reply; a failure propagates (the route answers it
    with an error status)."""
    async for item in events:
        if isinstance(item, Usage):
            builder.done(item)
        else:
            builder.step(item)
