"""POST /v1/chat/completions: a prepared chat (server/chat_prep.py), its events rendered as OpenAI's
chat.completion, or as chat.completion.chunk events when streamed."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from vinoserve.server.chat_prep import PreparedChat, prepare_chat
from vinoserve.server.delivery import error_event, event_stream_response, sse, unless_disconnected
from vinoserve.server.echo import vllm_prompt_logprobs
from vinoserve.server.event_stream import collect
from vinoserve.server.events import (ChoiceResult, Finish, Logprobs, ReasoningDelta, Step, TextDelta, ToolCallDelta,
                                     ToolCallStart, Usage)
from vinoserve.server.logprobs import token_entry
from vinoserve.server.protocol import ChatCompletionRequest, new_id, now
from vinoserve.server.serving import Serving, current

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, serving: Serving = Depends(current)) -> Response:
    serving.check_model(req.model)
    prepared = await prepare_chat(serving, req)
    streams = serving.admit([prepared.prompt], prepared.params, "messages", req.cache_eviction, req.n,
                            prepared.images)
    events = serving.events([prepared.prompt], streams, prepared.choice_text)
    rid = new_id("chatcmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream_response(_chunks(events, rid, serving.model_name, req.n, include_usage), streams)
    return await unless_disconnected(raw, _reply(events, rid, serving, prepared, req.n), streams)


async def _reply(events: AsyncIterator[Step | Usage], rid: str, serving: Serving, prepared: PreparedChat,
                 n: int) -> JSONResponse:
    results, usage = await collect(events, n)
    reasoning = prepared.reasoning is not None
    body = {"id": rid, "object": "chat.completion", "created": now(), "model": serving.model_name,
            "choices": [{"index": r.index, "message": message(r, reasoning),
                         "logprobs": {"content": r.logprobs} if r.logprobs is not None else None,
                         "finish_reason": r.finish_reason} for r in results],
            "usage": usage.openai()}
    if (k := prepared.scoring.prompt_logprobs) is not None:  # once for the prompt, as vLLM does
        body["prompt_logprobs"] = vllm_prompt_logprobs(prepared.prompt, results[0].prompt_logprobs or [], k,
                                                       lambda t, lp: token_entry(serving.tokenizer, t, lp))
    return JSONResponse(body)


def message(r: ChoiceResult, reasoning: bool) -> dict:
    """The assistant message of a whole choice. Content is null beside tool calls or reasoning
    when the model wrote no answer text."""
    text = r.text if r.had_text else (None if r.tool_calls or reasoning else "")
    out: dict = {"role": "assistant", "content": text}
    if reasoning:  # both names: `reasoning` is vLLM's newer one
        out["reasoning_content"] = out["reasoning"] = r.reasoning
    if r.tool_calls:
        out["tool_calls"] = [c.openai() for c in r.tool_calls]
    return out


async def _chunks(events: AsyncIterator[Step | Usage], rid: str, model: str, n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    try:
        async for item in events:
            if isinstance(item, Usage):
                if include_usage:
                    yield chunk([], item.openai())
                continue
            for choice in step_choices(item):
                yield chunk([choice])
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield sse(error_event(e))
        return
    yield sse("[DONE]")


def step_choices(step: Step) -> list[dict]:
    """A step as chunk choices: one per delta; its logprobs on the first; the finish on the last
    text delta, or on a chunk of its own after tool calls (as OpenAI sends it)."""
    deltas, entries, finish = [], None, None
    for e in step.events:
        if isinstance(e, TextDelta):
            deltas.append({"content": e.text})
        elif isinstance(e, ReasoningDelta):
            deltas.append({"reasoning_content": e.text, "reasoning": e.text})
        elif isinstance(e, ToolCallStart):
            deltas.append({"tool_calls": [{"index": e.call_index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, ToolCallDelta):
            deltas.append({"tool_calls": [{"index": e.call_index, "function": {"arguments": e.arguments}}]})
        elif isinstance(e, Logprobs):
            entries = e.entries
        elif isinstance(e, Finish):
            finish = e
    if finish is not None and (not deltas or "tool_calls" in deltas[-1]):
        deltas.append({})
    elif entries and not deltas:
        deltas.append({})  # a token that completed nothing yet still carries its logprobs
    choices = [{"index": step.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if choices and entries:
        choices[0]["logprobs"] = {"content": entries}
    if finish is not None:
        last = choices[-1]
        if last["delta"] == {"content": ""}:
            last["delta"] = {}
        last["finish_reason"] = finish.reason
    return choices
