"""Per-request limits, each a `vinoserve serve` flag: what one client may ask of the server.
Breaking one is a 400 (413 for the body) naming the parameter; capacity is --max-queue's 503."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vinoserve.server.errors import APIError, ErrorShape, shape_for

# Seconds a client told "at capacity" should wait before retrying (the Retry-After header).
RETRY_AFTER_S = 1
MAX_N = 128  # OpenAI's limit on choices per request, whatever --max-n says


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 4 * 2**20  # a full 8k-token context is ~50 kB of text; 4 MiB is generous
    max_prompt_tokens: int | None = None  # None: only the model's context length bounds a prompt
    max_stop_strings: int = 16
    max_n: int = 16
    max_logprobs: int = 20  # top alternatives per token; the sampler's own ceiling is 20 too

    def check_request(self, req) -> None:
        """Bounds known before tokenizing: stop strings, n, logprobs (completions' int or chat's top_logprobs)."""
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.max_stop_strings:
            raise APIError(400, f"stop has {len(stop)} strings; this server allows at most {self.max_stop_strings}",
                           "stop")
        if req.n > self.max_n:
            raise APIError(400, f"n is {req.n}; this server allows at most {self.max_n}", "n")
        for name in ("logprobs", "top_logprobs"):
            k = getattr(req, name, None)
            if isinstance(k, int) and not isinstance(k, bool) and k > self.max_logprobs:
                raise APIError(400, f"{name} is {k}; this server allows at most {self.max_logprobs}", name)

    def bound(self, name: str) -> int | None:
        """The limit `name` as requests meet it (the OpenAPI document states it); None: none."""
        return min(self.max_n, MAX_N) if name == "max_n" else getattr(self, name)

    def check_prompts(self, prompts: list[list[int]], param: str) -> None:
        if self.max_prompt_tokens is None:
            return
        longest = max(map(len, prompts), default=0)
        if longest > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {longest} tokens; this server allows at most "
                                f"{self.max_prompt_tokens}", param)


def over_capacity(waiting: int) -> APIError:
    return APIError(503, f"the server is at capacity ({waiting} requests waiting); retry later",
                    code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


class BodySizeLimit:
    """413 for a request body over `max_bytes`, whether it declares its length or streams it
    chunked; the body is never read past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, shapes: dict[str, ErrorShape] | None = None) -> None:
        self.app, self.max_bytes, self.shapes = app, max_bytes, shapes  # shapes: as errors.install takes them

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            body = shape_for(scope["path"], self.shapes)(413, self._message(), None, "request_too_large")
            response = JSONResponse(body, status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body on to the error handlers.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)
