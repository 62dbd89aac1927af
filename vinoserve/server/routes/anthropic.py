"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and POST
/v1/messages/count_tokens. The request becomes a chat request (server/anthropic/request.py) and
runs the shared chat path; its events are rendered by server/anthropic/render.py. Errors on these
paths answer in Anthropic's shape (app.py installs server/anthropic/errors.py for them); the API
key may come as x-api-key, and the anthropic-version header is accepted whatever it says."""
from __future__ import annotations

from dataclasses import replace
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from vinoserve.server.anthropic.render import MessageBuilder, anthropic_id
from vinoserve.server.anthropic.request import CountTokensRequest, MessagesRequest, chat_fields
from vinoserve.server.builders import built, streamed
from vinoserve.server.chat_prep import chat_prompt, chat_request, prepare_chat
from vinoserve.server.delivery import event_stream_response, sse, unless_disconnected
from vinoserve.server.errors import APIError, renamed
from vinoserve.server.serving import Serving, current
from vinoserve.server.tools import tool_plan

router = APIRouter()
# Chat fields the converted request may name in an error, and what this API calls them.
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config.format",
           "chat_template_kwargs": "thinking"}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request, serving: Serving = Depends(current)) -> Response:
    serving.check_model(body.model)
    try:
        prepared = await prepare_chat(serving, chat_request(chat_fields(body, serving.chat.reasoning is not None)))
        # As Anthropic's API does, max_tokens may exceed what the context leaves: the reply then
        # ends at the context's end, with stop_reason model_context_window_exceeded.
        room = max(1, serving.engine.max_context - len(prepared.prompt))
        if serving.engine.context_unbounded:  # evicting with rotation: no context's end to reach
            room = body.max_tokens
        params = replace(prepared.params, max_tokens=min(body.max_tokens, room))
        streams = serving.admit([prepared.prompt], params, "messages", images=prepared.images)
    except APIError as e:
        raise renamed(e, _FIELDS) from None
    events = serving.events([prepared.prompt], streams, prepared.choice_text)
    builder = MessageBuilder(anthropic_id("msg"), serving.model_name, len(prepared.prompt),
                             context_bound=params.max_tokens < body.max_tokens)
    if body.stream:
        return event_stream_response(_streamed(builder, events), streams)
    return await unless_disconnected(raw, _whole(builder, events), streams)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, serving: Serving = Depends(current)) -> JSONResponse:
    """The prompt's tokens as the model would see them: the chat template applied, tools declared."""
    serving.check_model(body.model)
    try:
        req = chat_request(chat_fields(body, serving.chat.reasoning is not None))
        _, ids, _ = await chat_prompt(serving, req, tool_plan(req), encode_images=False)
    except APIError as e:
        raise renamed(e, _FIELDS) from None
    return JSONResponse({"input_tokens": len(ids)})


async def _streamed(builder: MessageBuilder, events) -> AsyncIterator[str]:
    async for name, data in streamed(builder, events):
        yield sse(data, event=name)


async def _whole(builder: MessageBuilder, events) -> JSONResponse:
    await built(builder, events)
    return JSONResponse(builder.message)

