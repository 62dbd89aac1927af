"""GET /v1/models: every model served, each with what it serves ("tasks") and its context length;
the chat model also with the sampling defaults in force."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vinoserve.server.protocol import now

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = request.app.state.vinoserve
    registry = state.registry_ready()
    cards = []
    if (serving := state.serving) is not None:
        cards.append({"id": serving.model_name, "object": "model", "created": now(), "owned_by": "vinoserve",
                      "max_model_len": serving.engine.max_context, "tasks": ["chat", "completions"],
                      "sampling_defaults": serving.generation_defaults.values()})
    for name, encoder in registry.encoders.items():
        tasks = ["embeddings" if t == "embed" else t for t in encoder.tasks]
        cards.append({"id": name, "object": "model", "created": now(), "owned_by": "vinoserve",
                      "max_model_len": encoder.max_length, "tasks": tasks})
    return JSONResponse({"object": "list", "data": cards})
