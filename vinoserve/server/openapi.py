"""The OpenAPI document as the server really behaves: every status a route answers, with the
OpenAI error schema, and the content types it really sends. FastAPI's generated document
promises 422 for validation errors (we answer 400) and JSON for everything."""
from __future__ import annotations

import warnings
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from vinoserve.server.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATHS, AnthropicErrorResponse
from vinoserve.server.protocol import ErrorResponse
from vinoserve.server.routes.rerank import COHERE_PATH, CohereErrorResponse

_WHY = {400: "Invalid request (an error body naming the parameter)",
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
    "/metrics": ({"text/plain": {"schema": {"type": "string"}}}, ()),
    "/v1/models": (_JSON, _V1),
    "/v1/completions": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/chat/completions": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/responses": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/responses/{response_id}": (_JSON, (400, 404, 401)),
    "/v1/responses/{response_id}/input_items": (_JSON, (400, 404, 401)),
    "/v1/messages": ({**_JSON, **_SSE}, (*_BODY, *_V1, 500)),
    "/v1/messages/count_tokens": (_JSON, (*_BODY, *_V1)),
    "/tokenize": (_JSON, (*_BODY, *_V1)),
    "/detokenize": (_JSON, (*_BODY, *_V1)),
    **{path: (_JSON, (*_BODY, *_V1, 500)) for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank",
                                                       "/v1/score", "/score")},
}


# A POST whose 200 body's `id` names the resource of these paths (OpenAPI links, which a fuzzer's
# stateful phase follows from a created response to its GET, DELETE and input items).
_LINKS = {"/v1/responses": ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items")}


def install(app: FastAPI, vocab_size: Callable[[], int | None] = lambda: None,
            model_name: Callable[[], str | None] = lambda: None,
            reasons: Callable[[], bool | None] = lambda: None) -> None:
    """`vocab_size`, `model_name` and `reasons` (whether it reasons) give the model's, once it is
    loaded: token ids (fields marked x-token-id) are then documented as below it, fields marked
    x-model-name as the served name, and for a model that does not reason, fields marked
    x-without-reasoning as that marker's schema says. Until then the document is built afresh on
    each request."""
    def document() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():  # a route with two methods has one id for both; _link tells them apart
            warnings.filterwarnings("ignore", "Duplicate Operation ID")
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in (ErrorResponse, AnthropicErrorResponse, CohereErrorResponse):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for path, ops in doc["paths"].items():
            if path not in ROUTES:  # a route this table does not know: only drop the false 422
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
                continue
            content, statuses = ROUTES[path]
            shape = (AnthropicErrorResponse if path.startswith(ANTHROPIC_PATHS)
                     else CohereErrorResponse if path == COHERE_PATH else ErrorResponse)
            error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape.__name__}"}}}
            for op in ops.values():
                ok = {"description": "Success"}
                if content:
                    ok["content"] = content
                op["responses"] = {"200": ok, **{str(s): {"description": _WHY[s], "content": error}
                                                 for s in statuses}}
        _link(doc["paths"])
        vocab = vocab_size()
        _bound_token_ids(schemas, vocab, model_name(), reasons())
        if vocab is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = document


def _bound_token_ids(node, vocab: int | None, model: str | None = None, reasons: bool | None = None) -> None:
    """Token-id fields get `maximum: vocab - 1`, model-name fields `enum: [name]` (when known),
    and where the model does not reason, x-without-reasoning fields that marker's schema; the
    markers themselves go."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab is not None:
            node["maximum"] = vocab - 1
        if node.pop("x-model-name", False) and model is not None:
            node["enum"] = [model]
        if (narrowed := node.pop("x-without-reasoning", None)) is not None and reasons is False:
            kept = {k: node[k] for k in ("title", "description") if k in node}
            node.clear()
            node.update(narrowed, **kept)
        for value in node.values():
            _bound_token_ids(value, vocab, model, reasons)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab, model, reasons)


def _link(paths: dict) -> None:
    """Links from each _LINKS source to its targets' operations, each with an id of its own
    (FastAPI names both methods of a GET + DELETE route after the first)."""
    seen = set()
    for ops in paths.values():
        for method, op in ops.items():
            if op.get("operationId") in seen:
                op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
            seen.add(op.get("operationId"))
    for source, targets in _LINKS.items():
        by_id = {"response_id": "$response.body#/id"}
        links = {op["operationId"]: {"operationId": op["operationId"], "parameters": by_id}
                 for target in targets for op in paths.get(target, {}).values()}
        for op in paths.get(source, {}).values():
            op["responses"]["200"]["links"] = links
