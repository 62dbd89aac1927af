"""What the embeddings, rerank and score routes share: the registry dependency, inputs -> token
sequences under the model's length (cut where the request says so, a 400 naming the input
otherwise), and running them through the encoder's batcher."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import Request
from pydantic import WithJsonSchema

from vinoserve.model.encoders.packing import Sequence
from vinoserve.model.encoders.tokenizer import TooLong
from vinoserve.server.errors import APIError
from vinoserve.server.protocol import bounded_int
from vinoserve.server.registry import EncoderServing, ModelRegistry

# Inputs per request at most: OpenAI's limit for /v1/embeddings' list; rerank and score documents
# the same (Cohere allows 1000; the flag --max-pooling-inputs would be where to change it).
MAX_INPUTS = 2048
TEXT_SCHEMA = {"type": "string", "minLength": 1}


def inputs_schema(item: dict) -> dict:
    """A list of inputs as the OpenAPI document states it (check_count refuses the others with its
    own words): one at least, MAX_INPUTS at most."""
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_INPUTS}


# vLLM's truncate_prompt_tokens: -1 (the model's limit) or a count of tokens; 0 is a 400.
TruncateTokens = Annotated[bounded_int(ge=-1), WithJsonSchema({"type": "integer", "minimum": -1,
                                                                "not": {"const": 0}})]


def registry(request: Request) -> ModelRegistry:
    """FastAPI dependency: the registry once every model is loaded, else the 503 saying why."""
    return request.app.state.vinoserve.registry_ready()


@dataclass(frozen=True)
class Truncation:
    """`tokens`: cut each input to this many (special tokens included); None: refuse longer."""

    tokens: int | None

    @classmethod
    def of(cls, truncate_prompt_tokens: int | None, limit: int) -> Truncation:
        """vLLM's truncate_prompt_tokens: k cuts to k tokens, -1 to the model's limit."""
        if truncate_prompt_tokens is None:
            return cls(None)
        if truncate_prompt_tokens == -1 or truncate_prompt_tokens > limit:
            return cls(limit)
        return cls(truncate_prompt_tokens)


def check_count(n: int, param: str) -> None:
    if n == 0:
        raise APIError(400, f"{param} must not be empty", param)
    if n > MAX_INPUTS:
        raise APIError(400, f"{param} has {n} entries, over the limit of {MAX_INPUTS} per request", param)


def encode_texts(encoder: EncoderServing, texts: list[str] | list[tuple[str, str]], truncation: Truncation,
                 param: str) -> list[Sequence]:
    limit = truncation.tokens or encoder.max_length
    try:
        encoded = encoder.model.tokenizer.encode(texts, limit, truncate=truncation.tokens is not None)
    except TooLong as e:
        if truncation.tokens is not None:  # the model's special tokens (and a pair's two texts) do not fit
            raise APIError(400, f"truncate_prompt_tokens: {param}[{e.index}] cannot be cut to {truncation.tokens} "
                                f"tokens, as the model adds special tokens to each input ({e.length} tokens left)",
                           "truncate_prompt_tokens") from None
        raise APIError(400, f"{param}[{e.index}] has {e.length} tokens, over the model's limit of {e.limit} "
                            f"(truncate_prompt_tokens cuts inputs to a length)", param, "context_length_exceeded")
    return [Sequence(e.ids, e.type_ids) for e in encoded]


def token_sequences(encoder: EncoderServing, ids: list[list[int]], truncation: Truncation,
                    param: str) -> list[Sequence]:
    """Token-id inputs, used as given (special tokens are the client's to add); cut to their
    first tokens when the request truncates."""
    vocab, limit = encoder.model.tokenizer.vocab_size, truncation.tokens or encoder.max_length
    out = []
    for i, seq in enumerate(ids):
        if not seq:
            raise APIError(400, f"{param}[{i}] is empty", param)
        if max(seq) >= vocab:
            raise APIError(400, f"{param}[{i}] has token id {max(seq)}, outside the vocabulary of {vocab}", param)
        if len(seq) > limit and truncation.tokens is None:
            raise APIError(400, f"{param}[{i}] has {len(seq)} tokens, over the model's limit of {limit} "
                                f"(truncate_prompt_tokens cuts inputs to a length)", param, "context_length_exceeded")
        out.append(Sequence(seq[:limit]))
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, H] arrays."""
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return (a * b).sum(1) / norms


async def relevance(encoder: EncoderServing, pairs: list[tuple[str, str]], truncation: Truncation,
                    param: str) -> tuple[np.ndarray, int]:
    """Scores of (query, document) pairs and the tokens read: a cross-encoder's on each pair, an
    embedder's cosine of the two texts' vectors."""
    if encoder.model.config.is_classifier:
        seqs = encode_texts(encoder, pairs, truncation, param)
        return encoder.scores(await encoder.batcher.run(seqs)), sum(len(s.ids) for s in seqs)
    firsts = list(dict.fromkeys(p[0] for p in pairs))  # one query scored against many: embed it once
    seqs = encode_texts(encoder, firsts + [p[1] for p in pairs], truncation, param)
    rows = await encoder.batcher.run(seqs)
    where = {text: i for i, text in enumerate(firsts)}
    queries = rows[[where[p[0]] for p in pairs]]
    return cosine(queries, rows[len(firsts):]).astype(np.float64), sum(len(s.ids) for s in seqs)
