"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}}, never a traceback."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vinoserve.engine.async_engine import EngineDead, RequestFailed
from vinoserve.scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


_PARAMS = {f.name for f in fields(SamplingParams)}


def bad_value(e: ValueError, default_param: str | None = None) -> APIError:
    """A ValueError from validation; SamplingParams' messages start with the parameter's name."""
    message = str(e)
    first = message.split(" ", 1)[0]
    return APIError(400, message, first if first in _PARAMS else default_param)


def failure(e: Exception) -> tuple[int, str, str | None]:
    """Status, message and code for an error met while serving a request. Only what the client
    caused is a 4xx; a fault of ours is a 500 that says which request failed, never a traceback."""
    if isinstance(e, APIError):
        return e.status, e.message, e.code
    if isinstance(e, RequestFailed):
        return 500, f"this request failed inside the server: {e}", "request_failed"
    if isinstance(e, EngineDead):
        return 500, str(e), "engine_dead"
    log.error("unhandled error", exc_info=e)
    return 500, "internal server error", None


# Pydantic names the branch of a union it tried in the error's location ("constrained-str",
# "list[int]"); the client only needs the field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|[\[\]-]")


def invalid(errs: list[dict]) -> APIError:
    """pydantic's validation errors as one 400 in OpenAI's words, naming the field; pydantic's own
    structure stays inside. Of a union's per-branch errors, the one that got furthest says most:
    not a type mismatch, the deepest location."""
    field = tuple(errs[0].get("loc", ()))[:2] if errs else ()
    field = field if field[:1] == ("body",) else field[:1]  # a request body's fields are under "body"
    same = [x for x in errs if tuple(x.get("loc", ()))[:len(field)] == field]
    first = min(same, key=lambda x: (x.get("type", "").endswith("_type"), -len(x.get("loc", ())))) if same else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p))]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")  # our validators' own words
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    return APIError(400, f"{param}: {message}" if param else message, param)


ErrorShape = Callable[[int, str, str | None, str | None], dict]


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """`e`, raised for a request another API built (a ChatCompletionRequest), naming that API's
    field instead: its first segment looked up in `names` (messages.0.content -> input)."""
    head = (e.param or "").split(".", 1)[0]
    if head in names:
        if e.message.startswith(e.param) and e.message[len(e.param):][:1] in (":", " "):
            e.message = names[head] + e.message[len(e.param):]
        e.param = names[head]
    return e


def shape_for(path: str, shapes: dict[str, ErrorShape] | None) -> ErrorShape:
    """The error body for `path`: `shapes[prefix]`'s under a prefix, else OpenAI's."""
    return next((f for prefix, f in (shapes or {}).items() if path.startswith(prefix)), error_body)


def install(app: FastAPI, shapes: dict[str, ErrorShape] | None = None) -> None:
    """Error handlers answering in OpenAI's body, or in `shapes[prefix]`'s for paths under a prefix
    (the Anthropic Messages API answers in Anthropic's)."""
    def respond(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
        body = shape_for(request.url.path, shapes)(status, message, param, code)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError) -> JSONResponse:
        return respond(request, e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        error = invalid(e.errors())
        return respond(request, error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return respond(request, e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(RequestFailed)
    @app.exception_handler(EngineDead)
    async def _failed(request: Request, e: Exception) -> JSONResponse:
        # Registered by class, so Starlette answers without re-raising: the engine logged it.
        status, message, code = failure(e)
        return respond(request, status, message, code=code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        status, message, code = failure(e)
        return respond(request, status, message, code=code)
