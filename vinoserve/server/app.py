"""The FastAPI app: routes, auth, health, metrics; the models load in the background
(server/app_state.py) so /health can say 503 while they do."""
from __future__ import annotations

import asyncio
import importlib.resources
import secrets
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from vinoserve.server import errors, openapi
from vinoserve.server.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATHS, anthropic_error
from vinoserve.server.app_state import AppState
from vinoserve.server.echo import has_fim
from vinoserve.server.errors import APIError
from vinoserve.server.limits import BodySizeLimit
from vinoserve.server.metrics import Metrics
from vinoserve.server.responses.store import ResponseStore
from vinoserve.server.request_rules import WITHOUT_EVICTION, WITHOUT_FIM, WITHOUT_IMAGES, WITHOUT_REASONING
from vinoserve.server.routes import anthropic, chat, completions, embeddings, models, rerank, responses, tokens
from vinoserve.server.server_config import ServerConfig, default_model_name

__all__ = ["ServerConfig", "create_app", "default_model_name"]

_API_ROUTES = (models, completions, chat, tokens, responses, anthropic, embeddings, rerank)


def create_app(config: ServerConfig, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """`on_fatal(reason)` (on the event loop) should stop the server with a non-zero status: a
    single-model server that cannot serve exits, so that systemd, Docker or Kubernetes restart it
    or say why. Without it a model that fails to load leaves the app answering 503 with the reason."""
    metrics = Metrics(config.model_name)  # scraped from the start; the engine's gauges join once it runs
    state = AppState(config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=state.load, args=(asyncio.get_running_loop(), on_fatal), name="vinoserve-load",
                         daemon=True).start()
        yield
        await state.shutdown()

    app = FastAPI(title="vinoserve", lifespan=lifespan)
    app.state.vinoserve = state  # what serving.current reads
    app.state.stored_responses = ResponseStore(config.max_stored_responses)
    # error bodies in Anthropic's shape on its API's paths, Cohere's on its rerank path
    shapes = {ANTHROPIC_PATHS: anthropic_error, **rerank.ERROR_SHAPES}
    errors.install(app, shapes)
    _document(app, state)
    app.add_middleware(BodySizeLimit, max_bytes=config.limits.max_request_bytes, shapes=shapes)
    _add_pages(app, state, metrics)
    auth = [Depends(_authorized(config.api_key))]
    for module in _API_ROUTES:
        app.include_router(module.router, dependencies=auth)
    return app


def _document(app: FastAPI, state: AppState) -> None:
    """The OpenAPI document as the server runs: the chat model's vocabulary, name, reasoning and
    fill-in-the-middle tokens once it is loaded, eviction, limits, and the encoders."""
    def facts() -> openapi.Facts:
        serving, config = state.serving, state.config
        loaded = serving is not None
        return openapi.Facts(
            serving.engine.vocab_size if loaded else None, config.model_name,
            {WITHOUT_REASONING: loaded and serving.chat.reasoning is None,
             WITHOUT_FIM: loaded and not has_fim(serving.tokenizer),
             WITHOUT_IMAGES: loaded and serving.engine.vision is None,
             WITHOUT_EVICTION: config.engine.cache_eviction is None}, config.limits, state.registry)

    openapi.install(app, facts)


def _authorized(api_key: str | None) -> Callable:
    """The dependency every API route has: the key as a bearer token or x-api-key, when one is set."""
    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           code="invalid_api_key")
    return authorized


def _add_pages(app: FastAPI, state: AppState, metrics: Metrics) -> None:
    """The chat page, /health and /metrics: open without the API key, for browsers and probes."""
    chat_page = importlib.resources.files("vinoserve.server").joinpath("static/chat.html").read_text()

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(chat_page)

    # HEAD too: probes and benchmark tools (aiperf) ask with HEAD whether an endpoint is there.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            state.registry_ready()
        except APIError as e:
            return errors.error_response(e.status, e.message, code=e.code, headers=e.headers)
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
