"""Rerank and score: POST /v1/rerank and /rerank (Jina's and vLLM's shape), /v2/rerank (Cohere's,
whose errors are Cohere's {"message"} body), and POST /v1/score (vLLM's text_1 / text_2, one to one
or one to many). A cross-encoder scores each pair; an embedder, the cosine of their vectors."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, WithJsonSchema

from vinoserve.server.errors import APIError
from vinoserve.server.pooling import (MAX_INPUTS, TEXT_SCHEMA, Truncation, TruncateTokens, check_count,
                                      inputs_schema, registry, relevance)
from vinoserve.server.protocol import _Request, bounded_int, new_id, now
from vinoserve.server.registry import EncoderServing, ModelRegistry

router = APIRouter()
COHERE_PATH = "/v2/rerank"

Text = Annotated[str, Field(min_length=1)]


class TextDocument(_Request):
    text: Text


Texts = Annotated[list[Text], WithJsonSchema(inputs_schema(TEXT_SCHEMA))]


class RerankRequest(_Request):
    model: str | None = None
    query: Text
    documents: Annotated[list[Text | TextDocument], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_INPUTS})]
    top_n: bounded_int(ge=0) | None = None  # 0 or none: all, best first
    return_documents: bool | None = None  # default: yes on /v1/rerank (Jina), no on /v2/rerank (Cohere v2)
    max_tokens_per_doc: bounded_int(ge=1) | None = None  # Cohere's: each document cut to this many tokens
    truncate_prompt_tokens: TruncateTokens | None = None


class ScoreRequest(_Request):
    model: str | None = None
    text_1: Text | Texts
    text_2: Text | Texts
    truncate_prompt_tokens: TruncateTokens | None = None


class CohereErrorResponse(BaseModel):
    """Cohere's error body, as the OpenAPI document states it for /v2/rerank."""

    message: str


def _cohere_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"message": message}


ERROR_SHAPES = {COHERE_PATH: _cohere_error}


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(req: RerankRequest, models: ModelRegistry = Depends(registry)) -> JSONResponse:
    encoder = models.pick(req.model, "rerank", "rerank")
    results, tokens = await _rank(encoder, req, return_documents=req.return_documents is not False)
    return JSONResponse({"id": new_id("rerank"), "model": encoder.name, "usage": {"total_tokens": tokens},
                         "results": results})


@router.post(COHERE_PATH)
async def rerank_v2(req: RerankRequest, models: ModelRegistry = Depends(registry)) -> JSONResponse:
    encoder = models.pick(req.model, "rerank", "rerank")
    # Cohere truncates long documents rather than refusing them (max_tokens_per_doc, 4096 by default)
    if req.truncate_prompt_tokens is None:
        req = req.model_copy(update={"truncate_prompt_tokens": -1})
    results, tokens = await _rank(encoder, req, return_documents=bool(req.return_documents))
    return JSONResponse({"id": new_id("rerank"), "results": results,
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                                  "tokens": {"input_tokens": tokens, "output_tokens": 0}}})


async def _rank(encoder: EncoderServing, req: RerankRequest, return_documents: bool) -> tuple[list[dict], int]:
    check_count(len(req.documents), "documents")
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    if req.max_tokens_per_doc is not None:
        texts = encoder.model.tokenizer.cut(texts, req.max_tokens_per_doc)
    truncation = _truncation(req.truncate_prompt_tokens, encoder)
    scores, tokens = await relevance(encoder, [(req.query, t) for t in texts], truncation, "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            result["document"] = {"text": req.documents[i] if isinstance(req.documents[i], str)
                                  else req.documents[i].text}
        results.append(result)
    return results, tokens


@router.post("/v1/score")
@router.post("/score")
async def score(req: ScoreRequest, models: ModelRegistry = Depends(registry)) -> JSONResponse:
    encoder = models.pick(req.model, "score", "/v1/score")
    firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    check_count(len(firsts), "text_1")
    check_count(len(seconds), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 for many "
                            f"text_2, or as many of each", "text_2")
    truncation = _truncation(req.truncate_prompt_tokens, encoder)
    scores, tokens = await relevance(encoder, list(zip(firsts, seconds)), truncation, "text_2")
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return JSONResponse({"id": new_id("score"), "object": "list", "created": now(), "model": encoder.name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _truncation(truncate_prompt_tokens: int | None, encoder: EncoderServing) -> Truncation:
    if truncate_prompt_tokens == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
    return Truncation.of(truncate_prompt_tokens, encoder.max_length)
