"""Responses items (input messages, function_call, function_call_output, reasoning; a response's
own output items are the same kinds) as chat messages for the template, and as stored items.

A turn's items come apart in the Responses API: reasoning, then a message, then its calls, each
an item. They are put back together into one assistant message (content, reasoning_content,
tool_calls), as vLLM and llama.cpp do. Anything a text model with function tools cannot honour (an
image, a built-in tool's call, a reference to an item this server does not keep) is a 400."""
from __future__ import annotations

import uuid

from vinoserve.server.errors import APIError

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_messages(items: list, where: str = "input") -> list[dict]:
    """Chat messages for `items`; 400 naming the item (`input[2]`) for what cannot be honoured."""
    messages: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows
    for i, item in enumerate(items):
        param = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{param} must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, param)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", param), "type": "function",
                    "function": {"name": _text(item, "name", param), "arguments": _text(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(output, f"{param}.output", "input_text")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", param), "content": content})
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, param)
        elif kind == "item_reference":
            raise APIError(400, f"{param}: item_reference is not supported; send the item itself or use "
                                "previous_response_id", param)
        else:
            raise APIError(400, f"{param}: input items of type {kind!r} are not supported (this server has function "
                                "tools only)", f"{param}.type")
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


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(400, f"{param}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{param}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts(content, f"{param}.content", *_TEXT_PARTS, "refusal")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts(parts: object, param: str, *kinds: str) -> str:
    """The text of a list of content parts; an image, file or audio part is refused."""
    if not isinstance(parts, list):
        raise APIError(400, f"{param} must be a string or a list of content parts", param)
    text = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise APIError(400, f"{param}[{k}]: content parts of type {kind!r} are not supported (this server serves "
                                f"a text model; expected {' or '.join(kinds)})", f"{param}[{k}].type")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise APIError(400, f"{param}[{k}] needs its text as a string", f"{param}[{k}]")
        text.append(value)
    return "".join(text)


def _text(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning item's own text (its content), else its summary's."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if parts:
            return _parts(parts, f"{param}.{key}", kind)
    return ""


def leading_system(messages: list[dict]) -> list[dict]:
    """Instructions and the system/developer messages before the first turn as one system
    message: many templates accept a system message only first."""
    n = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n])}, *messages[n:]]
