"""OpenAI's Responses API: POST /v1/responses (whole or streamed), and GET / DELETE of a stored
response and its input items. The request becomes a chat request (server/responses/request.py)
and runs the shared chat path; its events are rendered by server/responses/render.py."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.chat_prep import chat_request, prepare_chat
from vinoserve.server.delivery import event_stream_response, sse, unless_disconnected
from vinoserve.server.errors import APIError, renamed
from vinoserve.server.responses.items import first_image, item_id, leading_system, listed, to_messages
from vinoserve.server.builders import built, streamed
from vinoserve.server.responses.render import ResponseBuilder
from vinoserve.server.responses.request import ResponsesRequest, chat_fields
from vinoserve.server.responses.store import ResponseStore, StoredResponse
from vinoserve.server.responses.tools import offered_tools
from vinoserve.server.serving import Serving, current

router = APIRouter()
# The header naming the response a POST created, streamed or not (the OpenAPI document's links use it).
RESOURCE_ID = "X-Response-Id"
# Chat fields the converted request may name in an error, and what this API calls them.
_FIELDS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "chat_template_kwargs": "reasoning.effort"}


def stored_responses(request: Request) -> ResponseStore:
    return request.app.state.stored_responses


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request, serving: Serving = Depends(current),
                          store: ResponseStore = Depends(stored_responses)) -> Response:
    serving.check_model(body.model)
    earlier = store.get(body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id else []
    items = body.items()
    if serving.engine.vision is None and (at := first_image(items)) is not None:
        raise APIError(400, "this model takes no images: serve a vision model with its projector (--mmproj)", at)
    instructions = [{"type": "message", "role": "system", "content": body.instructions}] if body.instructions else []
    try:
        messages = leading_system(to_messages([*instructions, *earlier, *items]))
        offered = offered_tools(body.tools)
        req = chat_request(chat_fields(body, messages, serving.chat.reasoning is not None, offered))
        prepared = await prepare_chat(serving, req)
        streams = serving.admit([prepared.prompt], prepared.params, "input", images=prepared.images)
    except APIError as e:
        raise renamed(e, _FIELDS) from None
    events = serving.events([prepared.prompt], streams, prepared.choice_text)
    builder = ResponseBuilder(_echoed(body, serving.model_name, prepared.params),
                              lambda text: len(serving.tokenizer.encode(text, add_special_tokens=False)),
                              offered.split)

    def keep(response: dict) -> None:
        if body.store:
            store.put(StoredResponse(response, listed(items), [*earlier, *items, *response["output"]]))

    if body.stream:
        response = event_stream_response(_streamed(builder, events, keep), streams)
    else:
        response = await unless_disconnected(raw, _whole(builder, events, keep), streams)
    if warning := offered.warning():
        response.headers["Warning"] = warning
    response.headers[RESOURCE_ID] = builder.response["id"]
    return response


@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
async def stored_response(response_id: str, raw: Request,
                          stream: bool = Query(False, json_schema_extra={"const": False},
                                               description="a stored response is not streamed again"),
                          store: ResponseStore = Depends(stored_responses)) -> JSONResponse:
    """GET: the stored response; DELETE: forget it. One route, so that a 405 lists both methods."""
    if stream:
        raise APIError(400, "a stored response is not streamed again; GET it without stream", "stream")
    if raw.method == "GET":
        return JSONResponse(store.get(response_id).response)
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = "desc", after: str | None = None,
                      store: ResponseStore = Depends(stored_responses)) -> JSONResponse:
    items = store.get(response_id).input_items
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise APIError(404, f"No input item found with id '{after}'.", "after", "not_found")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def _streamed(builder: ResponseBuilder, events, keep: Callable[[dict], None]) -> AsyncIterator[str]:
    async for event in streamed(builder, events):
        if event["type"] in ("response.completed", "response.incomplete"):
            keep(builder.response)  # before the client hears of it, so that it can continue from it
        yield sse(event, event=event["type"])


async def _whole(builder: ResponseBuilder, events, keep: Callable[[dict], None]) -> JSONResponse:
    await built(builder, events)
    keep(builder.response)
    return JSONResponse(builder.response)


def _echoed(body: ResponsesRequest, model: str, params: SamplingParams) -> dict:
    """The Response's fields that say what was asked, sampling as it was applied."""
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice or "auto"
    return {"id": item_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": params.max_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
            "store": body.store, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools],
            "truncation": body.truncation or "disabled", "background": False}
