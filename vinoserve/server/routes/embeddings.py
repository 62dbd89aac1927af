"""POST /v1/embeddings (OpenAI): strings or token ids in, float or base64 vectors out, with
Matryoshka `dimensions` (cut, then renormalised) and usage."""
from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import Field, WithJsonSchema

from vinoserve.server.errors import APIError
from vinoserve.server.pooling import (TEXT_SCHEMA, Truncation, TruncateTokens, check_count, encode_texts,
                                      inputs_schema, registry, token_sequences)
from vinoserve.server.protocol import TokenId, _Request, bounded_int
from vinoserve.server.registry import ModelRegistry

router = APIRouter()

TokenList = Annotated[list[TokenId], Field(min_length=1)]
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# What the route refuses with its own words (an empty text, no inputs, too many) the document states.
_INPUT = {"anyOf": [TEXT_SCHEMA, inputs_schema(TEXT_SCHEMA), _TOKENS, inputs_schema(_TOKENS)]}


class EmbeddingRequest(_Request):
    model: str | None = None
    input: Annotated[str | list[str] | TokenList | list[TokenList], WithJsonSchema(_INPUT)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: bounded_int(ge=1) | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None  # vLLM's: cut inputs to this many tokens (-1: the limit)


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, models: ModelRegistry = Depends(registry)) -> JSONResponse:
    encoder = models.pick(req.model, "embed", "/v1/embeddings")
    if req.truncate_prompt_tokens == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
    truncation = Truncation.of(req.truncate_prompt_tokens, encoder.max_length)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    if inputs and isinstance(inputs[0], int):
        inputs = [inputs]
    check_count(len(inputs), "input")
    if isinstance(inputs[0], str):
        if empty := [i for i, text in enumerate(inputs) if not text]:
            raise APIError(400, f"input[{empty[0]}] is an empty string", "input")
        seqs = encode_texts(encoder, inputs, truncation, "input")
    else:
        seqs = token_sequences(encoder, inputs, truncation, "input")
    vectors = await encoder.batcher.run(seqs)
    if req.dimensions is not None:
        vectors = _shorten(vectors, req.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(s.ids) for s in seqs)
    return JSONResponse({"object": "list", "data": data, "model": encoder.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka: the first `dimensions` components, L2-normalised again."""
    if dimensions > vectors.shape[1]:
        raise APIError(400, f"dimensions {dimensions} is over the model's {vectors.shape[1]}", "dimensions")
    cut = vectors[:, :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as the openai SDK decodes it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()

