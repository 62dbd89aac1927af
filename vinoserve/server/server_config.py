"""What `vinoserve serve` was asked to run: the engine, the served names, limits and chat setup."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.server.limits import Limits
from vinoserve.server.media import MediaPolicy


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
    media: MediaPolicy = field(default_factory=MediaPolicy)  # images: what is fetched and accepted
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id, least recently used dropped
    chat_model: bool = True  # False: only encoders are served (every --model named one)
    encoders: tuple[tuple[str, str], ...] = ()  # (served name, directory) of each embedder or reranker
    encoder_threads: int | None = None  # inference threads of each encoder (default: all cores)
    encoder_share: float = 0.25  # while the chat model decodes, the time each encoder or vision tower may compute

    @property
    def model_name(self) -> str:
        """The chat model's name as clients give it."""
        return self.served_model_name or default_model_name(self.engine.model)


def default_model_name(model: str | None) -> str:
    """What the user named: the built-in name, a GGUF's stem, or an IR directory's name."""
    if model is None:
        return DEFAULT_MODEL.name
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model
