"""GET /v1/models: the one model served, with its context length and the sampling defaults in force."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from vinoserve.server.protocol import now
from vinoserve.server.serving import Serving, current

router = APIRouter()


@router.get("/v1/models")
async def models(serving: Serving = Depends(current)) -> JSONResponse:
    card = {"id": serving.model_name, "object": "model", "created": now(), "owned_by": "vinoserve",
            "max_model_len": serving.engine.max_context, "sampling_defaults": serving.generation_defaults.values()}
    return JSONResponse({"object": "list", "data": [card]})
