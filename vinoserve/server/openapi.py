"""The OpenAPI document as the server really behaves: every status a route answers, with the
OpenAI error schema, and the content types it really sends. FastAPI's generated document
promises 422 for validation errors (we answer 400) and JSON for everything."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from vinoserve.server.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATHS, AnthropicErrorResponse
from vinoserve.server.limits import Limits
from vinoserve.server.openapi_pooling import narrow_pooling
from vinoserve.server.protocol import ErrorResponse
from vinoserve.server.registry import ModelRegistry
from vinoserve.server.routes.rerank import COHERE_PATH, CohereErrorResponse
from vinoserve.server.routes.responses import RESOURCE_ID

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


# A POST whose 200 names the resource of these paths in the header RESOURCE_ID (OpenAPI links,
# which a fuzzer's stateful phase follows from a created response to its GET, DELETE and input
# items). A header, not the body's `id`: a streamed reply's body is events, not the object.
_LINKS = {"/v1/responses": ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items")}


@dataclass(frozen=True)
class Facts:
    """What the document states of the server as it runs (None: not known yet, the model loading)."""

    vocab: int | None = None  # the chat model's: token ids (fields marked x-token-id) are below it
    model: str | None = None  # the chat model's served name (fields marked x-model-name)
    narrowed: dict[str, bool] = field(default_factory=dict)  # marker -> whether fields so marked take its schema
    limits: Limits = Limits()  # the --max-* flags (fields marked x-limit)
    registry: ModelRegistry | None = None  # once every model has loaded: the pooling routes' models


def install(app: FastAPI, facts: Callable[[], Facts] = Facts) -> None:
    """The document as `facts()` makes it (request_rules.py's markers narrowed, the pooling routes
    shaped by openapi_pooling.py); built afresh on each request until every model has loaded."""
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
        _responses(doc["paths"])
        _link(doc["paths"])
        now = facts()
        _narrow(schemas, now)
        if now.registry is not None:
            narrow_pooling(doc, now.registry)
            app.openapi_schema = doc
        return doc

    app.openapi = document


def _responses(paths: dict) -> None:
    """Each route's real statuses and content types, as ROUTES gives them."""
    for path, ops in paths.items():
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
            op["responses"] = {"200": ok, **{str(s): {"description": _WHY[s], "content": error} for s in statuses}}


def _narrow(node, facts: Facts) -> None:
    """Token-id fields get `maximum: vocab - 1`, model-name fields `enum: [name]` (when known),
    limited fields their limit, and fields with a marker of `facts.narrowed` that holds that
    marker's schema; the markers themselves go."""
    if isinstance(node, dict):
        if (bound := node.pop("x-limit", None)) is not None:
            keyword, name = bound
            if (value := facts.limits.bound(name)) is not None:
                node[keyword] = value
        if node.pop("x-token-id", False) and facts.vocab is not None:
            node["maximum"] = facts.vocab - 1
        if node.pop("x-token-id-key", False) and facts.vocab is not None:
            node["pattern"] = decimal_below(facts.vocab)
        if node.pop("x-model-name", False) and facts.model is not None:
            node["enum"] = [facts.model]
        for marker, applies in facts.narrowed.items():
            if (narrowed := node.pop(marker, None)) is not None and applies:
                kept = {k: node[k] for k in ("title", "description") if k in node}
                node.clear()
                node.update(narrowed, **kept)
        for value in node.values():
            _narrow(value, facts)
    elif isinstance(node, list):
        for value in node:
            _narrow(value, facts)


def decimal_below(n: int) -> str:
    """A regex of the decimal numbers in [0, n) (leading zeros allowed): token ids as a JSON
    object's keys (logit_bias), which JSON Schema bounds only by pattern."""
    top = str(n - 1)
    alternatives = ["0", f"[1-9][0-9]{{0,{len(top) - 2}}}"] if len(top) > 1 else []  # the shorter numbers
    for i, digit in enumerate(top):  # top's length: its prefix, a smaller digit here, then any digits
        low = "1" if i == 0 and len(top) > 1 else "0"
        if digit > low:
            rest = f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""
            alternatives.append(f"{top[:i]}[{low}-{chr(ord(digit) - 1)}]{rest}")
    alternatives.append(top)
    return f"^0*({'|'.join(alternatives)})$"


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
        by_id = {"response_id": f"$response.header.{RESOURCE_ID}"}
        links = {op["operationId"]: {"operationId": op["operationId"], "parameters": by_id}
                 for target in targets for op in paths.get(target, {}).values()}
        for op in paths.get(source, {}).values():
            op["responses"]["200"]["links"] = links
            op["responses"]["200"]["headers"] = {RESOURCE_ID: {
                "description": "the id of the response created (streamed or not)", "required": True,
                "schema": {"type": "string"}}}
