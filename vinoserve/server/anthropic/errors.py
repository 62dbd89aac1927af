"""Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}. The app
answers every error on a /v1/messages path in it (errors.install's shapes)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

PATH_PREFIX = "/v1/messages"

# Anthropic's error types by status; 503 (loading, over capacity) is its "overloaded_error".
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error body's schema, as the OpenAPI document states it for /v1/messages paths."""

    type: Literal["error"]
    error: AnthropicErrorBody
