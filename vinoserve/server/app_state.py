"""What the app holds while its models load and once they have: the chat model's Serving, the
encoders' registry, or why loading failed. Loading runs on a thread of its own so that /health can
answer 503 meanwhile; every route asks `ready()` (or `registry_ready()`) for what it needs."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.llm_engine import LLMEngine
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.errors import ModelLoadError, one_line
from vinoserve.model.generation_config import load_generation_defaults
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.errors import APIError
from vinoserve.server.metrics import Metrics
from vinoserve.server.registry import ModelRegistry
from vinoserve.server.server_config import ServerConfig
from vinoserve.server.serving import ChatSetup, Serving
from vinoserve.server.serving_models import load_encoders, log_memory

log = logging.getLogger("vinoserve")

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


class AppState:
    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
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

    def load(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[str], None] | None) -> None:
        """Every model, on the calling (loading) thread; `on_fatal(reason)` runs on `loop` when
        loading fails or the engine dies later."""
        def fatal(e: BaseException) -> None:  # engine thread
            if on_fatal is not None:
                loop.call_soon_threadsafe(loop.call_later, FATAL_EXIT_DELAY_S, on_fatal, f"the engine died ({e})")

        config = self.config
        try:
            if config.chat_model:
                self._load_chat(fatal)
            options = EncoderOptions(config.engine.compile.device, config.engine.compile.inference_precision,
                                     config.encoder_threads)
            self.registry = load_encoders(config.encoders, config.model_name if config.chat_model else None,
                                          options, log, self._chat_busy, config.encoder_share)
            if self.serving is not None:
                self.serving.registry = self.registry
            log_memory(self.registry, self.engine, log)
        except BaseException as e:  # surfaced by /health and every endpoint until the server exits
            self.load_error = e
            reason = f"model failed to load: {load_failure(e)}"
            log.debug("where the model failed to load", exc_info=e)
            if on_fatal is None:
                log.error("%s", reason)
            else:
                loop.call_soon_threadsafe(on_fatal, reason)

    def _chat_busy(self) -> bool:  # read from encoder threads: the engine's last published counters
        return self.engine is not None and self.engine.stats.num_running > 0

    def _load_chat(self, fatal: Callable[[BaseException], None]) -> None:
        config, name = self.config, self.config.model_name
        defaults = load_generation_defaults(config.generation_config, config.engine.model,
                                            config.override_generation_config)
        SamplingParams(**defaults.values())  # a bad default fails here, not as a 400 on every request
        engine = AsyncLLMEngine(LLMEngine(config.engine, log=log.info), on_fatal=fatal)
        self.metrics.watch(engine)
        self.engine = engine
        chat_setup = ChatSetup.build(engine.tokenizer, config.chat_template, config.tool_call_parser,
                                     config.reasoning_parser)
        self.serving = Serving(engine, name, self.metrics, config.max_queue, defaults, config.limits, chat_setup,
                               config.media, config.encoder_share)
        log.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
        log.info("chat: %s", chat_setup.describe())
        log.info("serving %s", name)

    async def shutdown(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.registry is not None:
            await asyncio.to_thread(self.registry.shutdown)
