"""The models one server serves, by the names requests use: the chat model (the paged engine,
through Serving) and any number of encoders (embedders, cross-encoder rerankers), each with its
own batcher. Routes ask the registry for the model a request names and the task it wants; a
model that cannot do that task is a 400 naming it, an unknown name a 404."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from vinoserve.model.encoders.batcher import EncoderBatcher
from vinoserve.model.encoders.model import EncoderModel
from vinoserve.server.errors import APIError

Task = Literal["chat", "embed", "rerank", "score"]
GENERATION_TASKS: tuple[Task, ...] = ("chat",)
_WORDS = {"chat": "chat and completions", "embed": "embeddings", "rerank": "rerank", "score": "score"}


@dataclass
class EncoderServing:
    """An encoder as routes use it: its model, batcher and what it can be asked for. An embedder
    also reranks and scores (cosine similarity of the two texts' vectors, as vLLM does)."""

    name: str
    model: EncoderModel
    batcher: EncoderBatcher

    @property
    def tasks(self) -> tuple[Task, ...]:
        return ("rerank", "score") if self.model.config.is_classifier else ("embed", "rerank", "score")

    @property
    def max_length(self) -> int:
        return self.model.config.max_length

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """A cross-encoder's relevance scores from its logits (sigmoid unless its config says not)."""
        first = logits[:, 0].astype(np.float64)
        return 1 / (1 + np.exp(-first)) if self.model.config.sigmoid else first

    def describe(self) -> str:
        kind = "cross-encoder" if self.model.config.is_classifier else f"{self.model.config.pooling}-pooled embedder"
        return (f"{self.name}: {kind} ({self.model.config.model_type}, {self.model.config.num_layers} layers, "
                f"{self.max_length} tokens) from {self.model.path}, {self.model.inference_precision} inference, "
                f"{self.model.weight_bytes / 2**20:.0f} MiB of weights")


@dataclass
class ModelRegistry:
    chat: str | None = None  # the paged engine's served name, when there is one
    encoders: dict[str, EncoderServing] = field(default_factory=dict)

    def tasks_of(self, name: str) -> tuple[Task, ...]:
        return GENERATION_TASKS if name == self.chat else self.encoders[name].tasks

    @property
    def names(self) -> list[str]:
        return ([self.chat] if self.chat else []) + list(self.encoders)

    def pick(self, name: str | None, task: Task, endpoint: str) -> EncoderServing:
        """The encoder `name` for `task`; with no name, the only model that can do it."""
        if name is None:
            able = [e for e in self.encoders.values() if task in e.tasks]
            # A reranker beats an embedder at rerank and score when the request names neither.
            best = [e for e in able if e.model.config.is_classifier] if task != "embed" else able
            if len(best or able) == 1:
                return (best or able)[0]
            if not able:
                raise APIError(400, f"no model served here can serve {endpoint} (models: {self.summary()})",
                               "model", "model_not_supported")
            raise APIError(400, f"name the model for {endpoint}: several can serve it ({self.summary()})", "model")
        if name not in self.encoders and name != self.chat:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        if task not in self.tasks_of(name):
            raise APIError(400, f"the model `{name}` cannot serve {endpoint}: it serves "
                                f"{', '.join(_WORDS[t] for t in self.tasks_of(name))}", "model", "model_not_supported")
        return self.encoders[name]

    def summary(self) -> str:
        return "; ".join(f"{n} ({', '.join(_WORDS[t] for t in self.tasks_of(n))})" for n in self.names) or "none"

    def shutdown(self) -> None:
        for encoder in self.encoders.values():
            encoder.batcher.shutdown()
