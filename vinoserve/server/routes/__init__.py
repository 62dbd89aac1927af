"""One module per API surface, each a FastAPI APIRouter over the shared event stream.

A route validates its body (pydantic), prepares the request (chat-shaped APIs convert it into a
ChatCompletionRequest and call server/chat_prep.prepare_chat), admits it, and renders the
protocol-neutral events (server/events.py) once as a stream and once as a whole reply. app.py
includes each module's `router` with the API-key check; openapi.ROUTES lists the statuses and
content types each path answers. A new surface, e.g. the Responses API:

    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request, serving: Serving = Depends(current)):
        serving.check_model(body.model)
        req = chat_request({"messages": to_messages(body.input, body.instructions), "tools": ...,
                            "max_completion_tokens": body.max_output_tokens, "stream": body.stream})
        prepared = await prepare_chat(serving, req)
        streams = serving.admit([prepared.prompt], prepared.params, "input", images=prepared.images)
        events = serving.events([prepared.prompt], streams, prepared.choice_text)
        if body.stream:  # Step events -> response.output_text.delta, ... (delivery.sse(data, event=...))
            return event_stream_response(render_stream(events), streams)
        # A client that leaves while the reply is computed aborts it; render_reply awaits
        # collect(events, 1): ChoiceResult (text, reasoning, tool_calls, finish_reason) and Usage.
        return await unless_disconnected(raw, render_reply(events), streams)
"""
