"""Responses items (input messages, function_call, function_call_output, reasoning; a response's
own output items are the same kinds) as chat messages for the template, and as listed items.

A turn's items come apart in the Responses API: reasoning, then a message, then its calls, each
an item. They are put back together into one assistant message (content, reasoning_content,
tool_calls), as vLLM and llama.cpp do. The items arrive validated (server/responses/schema.py)."""
from __future__ import annotations

import uuid

from vinoserve.server.responses.tools import flat_name

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_messages(items: list[dict]) -> list[dict]:
    """Chat messages for validated items (as dicts)."""
    messages: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": "system" if item["role"] == "developer" else item["role"],
                       "content": _content(item["content"])}
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":  # a namespace's function under the name the model was offered
            name = flat_name(item.get("namespace"), item["name"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        elif kind == "reasoning":  # its own text (content), else its summary's
            reasoning = (reasoning or "") + (_text(item.get("content") or []) or _text(item.get("summary") or []))
    return messages


def listed(items: list[dict]) -> list[dict]:
    """Input items as GET /v1/responses/{id}/input_items lists them: each with an id, a message's
    text as content parts."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        item = {**item, "type": kind, "id": item.get("id") or item_id(_ID_PREFIX.get(kind, "item"))}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if kind in ("message", "function_call", "function_call_output"):
            item.setdefault("status", "completed")
        out.append(item)
    return out


def first_image(items: list[dict]) -> str | None:
    """Where the first input_image part of `items` is (input.N.message.content.K), if any."""
    return next((f"input.{i}.message.content.{k}" for i, item in enumerate(items)
                 if item.get("type", "message") == "message" and isinstance(item.get("content"), list)
                 for k, p in enumerate(item["content"]) if p.get("type") == "input_image"), None)


def _content(content: str | list[dict]) -> str | list[dict]:
    """A message's content for chat: its text, or its text and image parts where it holds images."""
    if isinstance(content, str) or not any(p.get("type") == "input_image" for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail")}}
            if p.get("type") == "input_image" else {"type": "text", "text": _text([p])} for p in content]


def _text(content: str | list[dict]) -> str:
    """A message's text: its parts' text (a refusal's words) in order."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", p.get("refusal", "")) for p in content)


def leading_system(messages: list[dict]) -> list[dict]:
    """Instructions and the system/developer messages before the first turn as one system
    message: many templates accept a system message only first."""
    n = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n])}, *messages[n:]]
