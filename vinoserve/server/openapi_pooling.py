"""The pooling routes (embeddings, rerank, score) in the OpenAPI document as the served encoders
make them: the model names each route takes (and whether it may go unnamed), and per embedder
the bounds its vocabulary, length and width put on /v1/embeddings. A route no served model can
answer is left out of the document (it answers a 400 saying so)."""
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
        if task == "embed":
            schema["allOf"] = [_embedder_bounds(e, e is default) for e in able]


def _able(registry: ModelRegistry, task: Task) -> list[EncoderServing]:
    return [e for e in registry.encoders.values() if task in e.tasks]


def _default(registry: ModelRegistry, task: Task) -> EncoderServing | None:
    """The encoder a request naming no model gets, or None where it must name one."""
    try:
        return registry.pick(None, task, task)
    except APIError:
        return None


def _embedder_bounds(encoder: EncoderServing, default: bool) -> dict:
    """For a request to `encoder`: token ids below its vocabulary, token lists no longer than it
    reads unless truncate_prompt_tokens cuts them, dimensions up to its width."""
    named = {"required": ["model"], "properties": {"model": {"const": encoder.name}}}
    top = encoder.model.tokenizer.vocab_size - 1
    limit = encoder.max_length
    bounds = [{"properties": {"input": {"items": {"maximum": top, "items": {"maximum": top}}}}},
              {"if": {"properties": {"truncate_prompt_tokens": {"type": "null"}}}, "then": {"properties": {"input": {
                  "if": {"items": {"type": "integer"}}, "then": {"maxItems": limit},
                  "else": {"items": {"maxItems": limit}}}}}}]
    width = encoder.model.config.hidden_size
    if encoder.model.config.model_type != "ir" and width > 0:  # an IR's config need not say its output's width
        bounds.append({"properties": {"dimensions": {"anyOf": [{"type": "null"}, {"maximum": width}]}}})
    unnamed = {"properties": {"model": {"type": "null"}}}
    return {"if": {"anyOf": [named, unnamed]} if default else named, "then": {"allOf": bounds}}
