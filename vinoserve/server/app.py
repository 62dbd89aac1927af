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
from fastapi.responses import HTMLResponse, JSONResponse, Response

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.errors import ModelLoadError, one_line
from vinoserve.model.generation_config import load_generation_defaults
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server import errors, openapi
from vinoserve.server.errors import APIError
from vinoserve.server.limits import BodySizeLimit, Limits
from vinoserve.server.metrics import Metrics
from vinoserve.server.openai_serving import OpenAIServing, num_choices
from vinoserve.server.echo import fill_in_the_middle, prompt_scoring
from vinoserve.server.structured import grammar_for
from vinoserve.server.tools import tool_plan
from vinoserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, now)

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


def default_model_name(model: str | None) -> str:
    """What the user named: the built-in name, a GGUF's stem, or an IR directory's name."""
    if model is None:
        return DEFAULT_MODEL.name
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


class _State:
    def __init__(self) -> None:
        self.serving: OpenAIServing | None = None
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None

    def ready(self) -> OpenAIServing:
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
    state = _State()
    name = config.served_model_name or default_model_name(config.engine.model)
    metrics = Metrics(name)  # scraped from the start; the engine's gauges join once it runs

    def load(loop: asyncio.AbstractEventLoop) -> None:
        def fatal(e: BaseException) -> None:  # engine thread
            if on_fatal is not None:
                loop.call_soon_threadsafe(loop.call_later, FATAL_EXIT_DELAY_S, on_fatal, f"the engine died ({e})")

        try:
            defaults = load_generation_defaults(config.generation_config, config.engine.model,
                                                config.override_generation_config)
            SamplingParams(**defaults.values())  # a bad default fails here, not as a 400 on every request
            engine = AsyncLLMEngine(LLMEngine(config.engine, log=log.info), on_fatal=fatal)
            metrics.watch(engine)
            state.engine = engine
            state.serving = OpenAIServing(engine, name, metrics, config.max_queue, defaults)
            log.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
            log.info("serving %s", name)
        except BaseException as e:  # surfaced by /health and every endpoint until the server exits
            state.load_error = e
            reason = f"model failed to load: {load_failure(e)}"
            log.debug("where the model failed to load", exc_info=e)
            if on_fatal is None:
                log.error("%s", reason)
            else:
                loop.call_soon_threadsafe(on_fatal, reason)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=load, args=(asyncio.get_running_loop(),), name="vinoserve-load",
                         daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="vinoserve", lifespan=lifespan)
    errors.install(app)
    openapi.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.limits.max_request_bytes)
    limits = config.limits

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
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
            state.ready()
        except APIError as e:
            return errors.error_response(e.status, e.message, code=e.code, headers=e.headers)
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        serving = state.ready()
        card = {"id": serving.model_name, "object": "model", "created": now(), "owned_by": "vinoserve",
                "max_model_len": serving.engine.engine.max_context,
                "sampling_defaults": serving.generation_defaults.values()}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        serving = state.ready()
        serving.check_model(req.model)
        limits.check_request(req)
        prompts = await asyncio.to_thread(serving.completion_prompts, req.prompt)  # big prompts take ms
        if req.suffix is not None:
            prompts = fill_in_the_middle(serving.tokenizer, prompts, req.suffix)
        limits.check_prompts(prompts, "prompt")
        k = req.logprobs
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        scoring = prompt_scoring(req, True, max_tokens)
        grammar = await grammar_for(req, serving.engine.engine.grammars)
        params = serving.sampling_params(req, 1 if scoring.score_only else max_tokens, max(map(len, prompts)), k,
                                         grammar, scoring.engine_k)
        streams = serving.admit(prompts, params, "prompt", req.cache_eviction, num_choices(req))
        return await serving.respond(raw, req, prompts, streams, chat=False, scoring=scoring)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        serving = state.ready()
        serving.check_model(req.model)
        limits.check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        tools = tool_plan(req)
        prompt = await asyncio.to_thread(serving.chat_prompt, req, tools)
        limits.check_prompts([prompt], "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        grammar = await grammar_for(req, serving.engine.engine.grammars, tools)
        scoring = prompt_scoring(req, False, max_tokens)
        params = serving.sampling_params(req, max_tokens, len(prompt),
                                         (req.top_logprobs or 0) if req.logprobs else None, grammar,
                                         scoring.engine_k)
        streams = serving.admit([prompt], params, "messages", req.cache_eviction, req.n)
        return await serving.respond(raw, req, [prompt], streams, chat=True, tools=tools, scoring=scoring)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        serving = state.ready()
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = serving.chat_prompt(ChatCompletionRequest(messages=req.messages,
                                                            add_generation_prompt=req.add_generation_prompt))
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": serving.engine.engine.max_context, "tokens": ids})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        serving = state.ready()
        serving.check_model(req.model)
        vocab = serving.engine.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})

    return app
