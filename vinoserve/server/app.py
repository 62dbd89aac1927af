"""The FastAPI app: routes, auth, health, metrics; the engine loads in the background so /health
can say 503 while it does."""
from __future__ import annotations

import asyncio
import importlib.resources
import logging
import secrets
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, one_line
from vinoserve.model.generation_config import load_generation_defaults
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server import errors, openapi
from vinoserve.server.errors import APIError
from vinoserve.server.limits import BodySizeLimit, Limits
from vinoserve.server.metrics import Metrics
from vinoserve.server.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATHS, anthropic_error
from vinoserve.server.responses.store import ResponseStore
from vinoserve.server.registry import ModelRegistry
from vinoserve.server.routes import anthropic, chat, completions, embeddings, models, rerank, responses, tokens
from vinoserve.server.serving_models import load_encoders, log_memory
from vinoserve.server.serving import ChatSetup, Serving

log = logging.getLogger("vinoserve")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # default: the model's directory name
    api_key: str | None = None
    max_queue: int | None = None
    limits: Limits = field(default_factory=Limits)
    generation_config: str = "auto"  # auto: the model's sampling defaults; vinoserve: OpenAI's; or a dir
    override_generation_config: dict | None = None
    chat_template: str | None = None  # --chat-template's text: replaces the model's
    tool_call_parser: str = "auto"  # a name in server/tools FORMATS, or auto
    reasoning_parser: str = "auto"  # a name in server/reasoning FORMATS, none, or auto
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id, least recently used dropped
    chat_model: bool = True  # False: only encoders are served (every --model named one)
    encoders: tuple[tuple[str, str], ...] = ()  # (served name, directory) of each embedder or reranker
    encoder_threads: int | None = None  # inference threads of each encoder (default: all cores)
    encoder_share: float = 0.25  # while the chat model decodes, the time each encoder may compute


def default_model_name(model: str | None) -> str:
    """What the user named: the built-in name, a GGUF's stem, or an IR directory's name."""
    if model is None:
        return DEFAULT_MODEL.name
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


class _State:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.serving: Serving | None = None
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.registry: ModelRegistry | None = None  # set once every model has loaded

    def registry_ready(self) -> ModelRegistry:
        if self.config.chat_model:
            self.ready()
        elif self.load_error is not None:
            raise APIError(503, f"model failed to load: {load_failure(self.load_error)}", code="model_not_ready")
        if self.registry is None:
            raise APIError(503, "the models are loading", code="model_not_ready", headers=_RETRY_WHILE_LOADING)
        return self.registry

    def ready(self) -> Serving:
        if not self.config.chat_model:
            registry = self.registry_ready()
            raise APIError(400, f"no chat model is served here (models: {registry.summary()})", "model",
                           "model_not_supported")
        if self.engine is not None and not self.engine.is_alive:
            raise APIError(503, f"the engine stopped: {self.engine.error}; the server is exiting",
                           code="engine_dead")
        if self.serving is None:
            if self.load_error is not None:
                raise APIError(503, f"model failed to load: {load_failure(self.load_error)}", code="model_not_ready")
            raise APIError(503, "the model is loading", code="model_not_ready", headers=_RETRY_WHILE_LOADING)
        return self.serving


# After the engine dies, /health answers 503 with the reason this long before the process exits
# non-zero, so that probes and logs see why an orchestrator restarts it.
FATAL_EXIT_DELAY_S = 2.0
# While the model loads, clients are told to come back after this long (the openai SDK waits as
# told, up to a minute, before each of its retries).
LOADING_RETRY_AFTER_S = 5
_RETRY_WHILE_LOADING = {"Retry-After": str(LOADING_RETRY_AFTER_S)}
# What a model that cannot load raises for reasons its message explains; anything else is a fault of
# ours, whose traceback --log-level debug shows.
_EXPECTED_LOAD_ERRORS = (ModelLoadError, ValueError, OSError)


def load_failure(e: BaseException) -> str:
    """One line saying why the model did not load."""
    if isinstance(e, _EXPECTED_LOAD_ERRORS):
        return one_line(e)
    return f"{type(e).__name__}: {one_line(e)} (--log-level debug shows where)"


def create_app(config: ServerConfig, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """`on_fatal(reason)` (on the event loop) should stop the server with a non-zero status: a
    single-model server that cannot serve exits, so that systemd, Docker or Kubernetes restart it
    or say why. Without it a model that fails to load leaves the app answering 503 with the reason."""
    state = _State(config)
    name = config.served_model_name or default_model_name(config.engine.model)
    metrics = Metrics(name)  # scraped from the start; the engine's gauges join once it runs

    def load(loop: asyncio.AbstractEventLoop) -> None:
        def fatal(e: BaseException) -> None:  # engine thread
            if on_fatal is not None:
                loop.call_soon_threadsafe(loop.call_later, FATAL_EXIT_DELAY_S, on_fatal, f"the engine died ({e})")

        try:
            if config.chat_model:
                load_chat(fatal)
            options = EncoderOptions(config.engine.compile.device, config.engine.compile.inference_precision,
                                     config.encoder_threads)
            state.registry = load_encoders(config.encoders, name if config.chat_model else None, options, log,
                                           chat_busy, config.encoder_share)
            if state.serving is not None:
                state.serving.registry = state.registry
            log_memory(state.registry, state.engine, log)
        except BaseException as e:  # surfaced by /health and every endpoint until the server exits
            state.load_error = e
            reason = f"model failed to load: {load_failure(e)}"
            log.debug("where the model failed to load", exc_info=e)
            if on_fatal is None:
                log.error("%s", reason)
            else:
                loop.call_soon_threadsafe(on_fatal, reason)

    def chat_busy() -> bool:  # read from encoder threads: the engine's last published counters
        return state.engine is not None and state.engine.stats.num_running > 0

    def load_chat(fatal: Callable[[BaseException], None]) -> None:
        defaults = load_generation_defaults(config.generation_config, config.engine.model,
                                            config.override_generation_config)
        SamplingParams(**defaults.values())  # a bad default fails here, not as a 400 on every request
        engine = AsyncLLMEngine(LLMEngine(config.engine, log=log.info), on_fatal=fatal)
        metrics.watch(engine)
        state.engine = engine
        chat_setup = ChatSetup.build(engine.tokenizer, config.chat_template, config.tool_call_parser,
                                     config.reasoning_parser)
        state.serving = Serving(engine, name, metrics, config.max_queue, defaults, config.limits, chat_setup)
        log.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
        log.info("chat: %s", chat_setup.describe())
        log.info("serving %s", name)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=load, args=(asyncio.get_running_loop(),), name="vinoserve-load",
                         daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if state.registry is not None:
            await asyncio.to_thread(state.registry.shutdown)

    app = FastAPI(title="vinoserve", lifespan=lifespan)
    app.state.vinoserve = state  # what serving.current reads
    app.state.stored_responses = ResponseStore(config.max_stored_responses)
    # error bodies in Anthropic's shape on its API's paths, Cohere's on its rerank path
    shapes = {ANTHROPIC_PATHS: anthropic_error, **rerank.ERROR_SHAPES}
    errors.install(app, shapes)
    openapi.install(app, vocab_size=lambda: state.engine.vocab_size if state.serving is not None else None,
                    model_name=lambda: name,
                    reasons=lambda: state.serving.chat.reasoning is not None if state.serving is not None else None)
    app.add_middleware(BodySizeLimit, max_bytes=config.limits.max_request_bytes, shapes=shapes)

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           code="invalid_api_key")

    auth = [Depends(authorized)]

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

    for module in (models, completions, chat, tokens, responses, anthropic, embeddings, rerank):
        app.include_router(module.router, dependencies=auth)

    return app
