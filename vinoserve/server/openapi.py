"""The OpenAPI document as the server really behaves: every status a route answers, with the
OpenAI error schema, and the content types it really sends. FastAPI's generated document
promises 422 for validation errors (we answer 400) and JSON for everything."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from vinoserve.server.protocol import ErrorResponse

_WHY = {400: "Invalid request (OpenAI error body naming the parameter)",
        401: "Missing or wrong API key (only when the server has --api-key)",
        404: "The model named is not the one served",
        413: "Request body over --max-request-bytes",
        500: "This request failed inside the server; others are unaffected",
        503: "The model is loading, the engine stopped, or the server is over capacity (with Retry-After)"}
_BODY = (400, 404, 413)  # statuses of routes that take a JSON body
_V1 = (401, 503)
_JSON = {"application/json": {"schema": {"type": "object"}}}
# Each event is a JSON chunk (or an error object), then the literal [DONE].
_SSE = {"text/event-stream": {"schema": {"anyOf": [{"type": "object"}, {"const": "[DONE]"}]}}}

# path -> (success content, error statuses)
ROUTES: dict[str, tuple[dict, tuple[int, ...]]] = {
    "/health": ({}, (503,)),
    "/metrics": ({"text/plain": {"schema": {"type": "string"}}}, (503,)),
    "/v1/models": (_JSON, _V1),
    "/v1/completions": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/chat/completions": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/responses": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/responses/{response_id}": (_JSON, (404, 401)),
    "/v1/responses/{response_id}/input_items": (_JSON, (400, 404, 401)),
    "/v1/messages": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/messages/count_tokens": (_JSON, (*_BODY, *_V1)),
    "/tokenize": (_JSON, (*_BODY, *_V1)),
    "/detokenize": (_JSON, (*_BODY, *_V1)),
}


def install(app: FastAPI, vocab_size: Callable[[], int | None] = lambda: None) -> None:
    """`vocab_size` gives the model's, once it is loaded: token ids (fields marked x-token-id) are
    then documented as below it. Until then the document is built afresh on each request."""
    def document() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs"))
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, ops in doc["paths"].items():
            if path not in ROUTES:  # a route this table does not know: only drop the false 422
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
                continue
            content, statuses = ROUTES[path]
            for op in ops.values():
                ok = {"description": "Success"}
                if content:
                    ok["content"] = content
                op["responses"] = {"200": ok, **{str(s): {"description": _WHY[s], "content": error}
                                                 for s in statuses}}
        vocab = vocab_size()
        _bound_token_ids(schemas, vocab)
        if vocab is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = document


def _bound_token_ids(node, vocab: int | None) -> None:
    """Token-id fields get `maximum: vocab - 1` (when known); the marker itself goes."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab is not None:
            node["maximum"] = vocab - 1
        for value in node.values():
            _bound_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab)
