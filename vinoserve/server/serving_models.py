"""Several models in one server: `--model NAME=PATH` (repeatable) sorted into the chat model (the
paged engine) and encoders, loaded into the registry, with each one's share of memory logged."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vinoserve.model.encoders.batcher import EncoderBatcher
from vinoserve.model.encoders.config import is_encoder_dir
from vinoserve.model.encoders.decoder import DecoderPooler, pooling_kind
from vinoserve.model.encoders.gguf import is_encoder_gguf
from vinoserve.model.encoders.ir import IREncoder, is_encoder_ir
from vinoserve.model.encoders.model import EncoderOptions, load_encoder
from vinoserve.server.registry import EncoderServing, ModelRegistry


@dataclass(frozen=True)
class ModelList:
    chat: tuple[str | None, str | None] | None  # (served name or None, path or None for the built-in)
    encoders: tuple[tuple[str, str], ...]


def parse_models(values: list[str] | None) -> ModelList:
    """`--model` values: PATH (served under its file or directory name) or NAME=PATH. At most one
    may be a generation model; none at all serves the built-in model alone."""
    if not values:
        return ModelList((None, None), ())
    chat, encoders, names = None, [], set()
    for value in values:
        name, path = _split(value)
        served = name or _default_name(path)
        if served in names:
            raise ValueError(f"--model: two models are served as {served!r}; name them NAME=PATH")
        names.add(served)
        if _is_pooling_model(Path(path).expanduser()):
            encoders.append((served, path))
        elif chat is not None:
            raise ValueError(f"--model: {chat[1]} and {path} are both generation models; one server runs one "
                             f"(embedders and rerankers beside it as many as you like)")
        else:
            chat = (name, path)
    return ModelList(chat, tuple(encoders))


def _is_pooling_model(path: Path) -> bool:
    """An encoder directory or GGUF, or a decoder GGUF marked as an embedder or reranker."""
    return is_encoder_dir(path) or is_encoder_ir(path) or is_encoder_gguf(path) or pooling_kind(path) is not None


def _split(value: str) -> tuple[str | None, str]:
    """NAME=PATH, unless the whole is an existing path or the name part looks like a path."""
    name, sep, path = value.partition("=")
    if not sep or Path(value).expanduser().exists() or "/" in name or not name or not path:
        return None, value
    return name, path


def _default_name(path: str) -> str:
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name or path


def load_encoders(encoders: tuple[tuple[str, str], ...], chat_name: str | None, options: EncoderOptions,
                  log: logging.Logger, chat_busy: Callable[[], bool] = lambda: False,
                  share: float = 1.0) -> ModelRegistry:
    """`chat_busy` and `share`: while the chat model decodes, each encoder computes at most `share`
    of the time (model/encoders/batcher.py says why)."""
    registry = ModelRegistry(chat=chat_name)
    for name, path in encoders:
        where = Path(path).expanduser()
        if pooling_kind(where) is not None:
            model = DecoderPooler(where, options, log=log.info)
        elif is_encoder_ir(where):
            model = IREncoder(where, options)
        else:
            model = load_encoder(where, options, log=log.info)
        batcher = EncoderBatcher(model, name=name, chat_busy=chat_busy, share=share)
        registry.encoders[name] = EncoderServing(name, model, batcher)
        log.info("serving %s", registry.encoders[name].describe())
    return registry


def log_memory(registry: ModelRegistry, engine, log: logging.Logger) -> None:
    """Each model's share: weights (the chat model's as loading held them, its KV cache too), so an
    operator sees what a second or third model costs before memory runs out."""
    shares = []
    if engine is not None:
        inner = engine.engine
        weights = inner.model.held_bytes or sum(f.stat().st_size for f in inner.model.weight_files)
        shares.append((registry.chat, weights + inner.cache.nbytes,
                       f"{weights / 2**30:.2f} GiB weights + {inner.cache.nbytes / 2**30:.2f} GiB KV cache"))
    for name, encoder in registry.encoders.items():
        shares.append((name, encoder.model.weight_bytes, f"{encoder.model.weight_bytes / 2**30:.2f} GiB weights"))
    total = sum(b for _, b, _ in shares) or 1
    log.info("memory by model: %s", "; ".join(f"{n} {100 * b / total:.0f}% ({what})" for n, b, what in shares))
