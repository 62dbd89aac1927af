"""How a reply reaches its client: a stream of server-sent events, or one JSON body. Either way a
client that leaves aborts its requests (their KV blocks free at the next engine step)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vinoserve.engine.async_engine import RequestStream
from vinoserve.server.errors import error_body, failure
from vinoserve.server.event_stream import close_all


def sse(data: dict | str, event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (or a literal such as [DONE]), named if `event`."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"event: {event}\ndata: {body}\n\n" if event else f"data: {body}\n\n"


def error_event(e: Exception) -> dict:
    """The OpenAI error body for a failure met after the status line went out."""
    status, message, code = failure(e)
    return error_body(status, message, code=code)


def event_stream_response(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    return _ClosingStreamingResponse(events, streams, media_type="text/event-stream")


class _ClosingStreamingResponse(StreamingResponse):
    """Starlette stops a stream on disconnect by cancelling it wherever it waits, possibly before
    the body iterator ever ran; closing the engine streams here aborts their requests either way."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self._streams)
            await self.body_iterator.aclose()


async def unless_disconnected(raw: Request, work: Awaitable[Response], streams: list[RequestStream]) -> Response:
    """Runs `work`; if the client goes away first, cancels it (its requests abort, blocks free).
    Either way both tasks are awaited here, so no task is left with an unretrieved exception."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        close_all(streams)
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()
