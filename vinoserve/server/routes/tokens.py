"""vLLM's POST /tokenize (a prompt, or messages through the chat template) and POST /detokenize."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from vinoserve.server.chat_prep import chat_prompt
from vinoserve.server.errors import APIError
from vinoserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from vinoserve.server.serving import Serving, current

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, serving: Serving = Depends(current)) -> JSONResponse:
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        _, ids, _ = await chat_prompt(serving, chat, encode_images=False)
    else:
        ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": serving.engine.max_context, "tokens": ids})


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, serving: Serving = Depends(current)) -> JSONResponse:
    serving.check_model(req.model)
    vocab = serving.engine.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):  # the OpenAPI document states this bound
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})
