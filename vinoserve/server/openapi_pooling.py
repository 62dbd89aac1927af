"""The pooling routes (embeddings, rerank, score) in the OpenAPI document as the served encoders
make them: the model names each route takes (and whether it may go unnamed), per embedder the
bounds its vocabulary, length and width put on /v1/embeddings, and the special tokens that
truncate_prompt_tokens cannot cut (a cross-encoder's pair keeps a token of each text as well, so
how far a pair can be cut depends on the texts: a 400 no schema states). A route no served model
can answer is left out of the document (it answers a 400 saying so)."""
from __future__ import annotations

from vinoserve.server.errors import APIError
from vinoserve.server.registry import EncoderServing, ModelRegistry, Task

PATHS: dict[str, Task] = {"/v1/embeddings": "embed", "/v1/rerank": "rerank", "/rerank": "rerank",
                          "/v2/rerank": "rerank", "/v1/score": "score", "/score": "score"}
REQUESTS: dict[str, Task] = {"EmbeddingRequest": "embed", "RerankRequest": "rerank", "ScoreRequest": "score"}


def narrow_pooling(doc: dict, registry: ModelRegistry) -> None:
    for path, task in PATHS.items():
        if path in doc["paths"] and not _able(registry, task):
            del doc["paths"][path]
    schemas = doc["components"]["schemas"]
    for name, task in REQUESTS.items():
        if name not in schemas or not (able := _able(registry, task)):
            continue
        schema, default = schemas[name], _default(registry, task)
        names = [e.name for e in able]
        schema["properties"]["model"] = {"enum": names + [None]} if default else {"enum": names}
        if default is None:
            schema.setdefault("required", []).append("model")
        schema["allOf"] = [{"if": _asks_for(e, e is default), "then": {"allOf": _bounds(e, task)}}
                           for e in able if not e.model.config.is_classifier]


def _able(registry: ModelRegistry, task: Task) -> list[EncoderServing]:
    return [e for e in registry.encoders.values() if task in e.tasks]


def _default(registry: ModelRegistry, task: Task) -> EncoderServing | None:
    """The encoder a request naming no model gets, or None where it must name one."""
    try:
        return registry.pick(None, task, task)
    except APIError:
        return None


def _asks_for(encoder: EncoderServing, default: bool) -> dict:
    """A request that goes to `encoder`: naming it, or (the `default`) naming none."""
    named = {"required": ["model"], "properties": {"model": {"const": encoder.name}}}
    return {"anyOf": [named, {"properties": {"model": {"type": "null"}}}]} if default else named


def _bounds(encoder: EncoderServing, task: Task) -> list[dict]:
    """For a request to an embedder: truncate_prompt_tokens not below the special tokens it adds to
    a text; on /v1/embeddings also token ids below its vocabulary, token lists no longer than it
    reads unless truncate_prompt_tokens cuts them, dimensions up to its width."""
    specials = len(encoder.model.tokenizer.encode([""], encoder.max_length, truncate=False)[0].ids)
    cut = [{"properties": {"truncate_prompt_tokens": {"anyOf": [{"type": "null"}, {"const": -1},
                                                                {"minimum": max(1, specials)}]}}}]
    if task != "embed":
        return cut
    top = encoder.model.tokenizer.vocab_size - 1
    limit = encoder.max_length
    bounds = [{"properties": {"input": {"items": {"maximum": top, "items": {"maximum": top}}}}},
              {"if": {"properties": {"truncate_prompt_tokens": {"type": "null"}}}, "then": {"properties": {"input": {
                  "if": {"items": {"type": "integer"}}, "then": {"maxItems": limit},
                  "else": {"items": {"maxItems": limit}}}}}}]
    width = encoder.model.config.hidden_size
    if encoder.model.config.model_type != "ir" and width > 0:  # an IR's config need not say its output's width
        bounds.append({"properties": {"dimensions": {"anyOf": [{"type": "null"}, {"maximum": width}]}}})
    return cut + bounds
