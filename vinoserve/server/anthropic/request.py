"""A POST /v1/messages body: validated here, then converted into a chat request's fields.

Honoured: system (a string or text blocks; system messages among the messages too, which Claude
Code sends), messages with text, image (base64 or url sources: a model served with its vision
projector, `--mmproj`), tool_use, tool_result (content as a string or text blocks;
is_error marks the result as an error) and thinking blocks, tools (name, description,
input_schema), tool_choice (auto, any, tool, none; disable_parallel_tool_use), stop_sequences,
max_tokens (past the context: the reply ends there), temperature, top_p, top_k, metadata, thinking
(enabled / adaptive / disabled turn a reasoning model's thinking on or off through its chat
template; budget_tokens is checked, and bounded only by max_tokens), output_config.format (a JSON
schema the answer is held to), output_config.effort high (the default) and context_management
that keeps all thinking (Claude Code sends both). Refused with a 400: documents, server
tools (web search, code execution, ...), MCP servers, containers, other efforts and context edits,
and thinking enabled on a model that does not reason (adaptive thinking there is no thinking).
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

from vinoserve.server.errors import APIError
from vinoserve.server.protocol import Int, _Request, bounded_int, unsupported
from vinoserve.server.request_rules import WITHOUT_IMAGES, WITHOUT_REASONING, limit, needs_tools, no_constraint_with_tools, not_null


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class Base64Source(_Request):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Request):
    type: Literal["url"]
    url: str  # fetched where the server allows its host (--allowed-media-domains)


class ImageBlock(_Request):
    model_config = ConfigDict(json_schema_extra={WITHOUT_IMAGES: {"not": {}}})
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def chat_part(self) -> dict:
        """As a chat image_url part: a base64 source as a data: URL."""
        s = self.source
        url = f"data:{s.media_type};base64,{s.data}" if isinstance(s, Base64Source) else s.url
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]  # another model's sealed reasoning: nothing this one can read
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


def _blocks(*kinds: str) -> dict:
    """The OpenAPI document's `content` of a turn that holds only these kinds of blocks."""
    return {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "properties": {"type": {"enum": list(kinds)}}}}]}}}


class InputMessage(_Request):
    # Which blocks a turn may hold (to_messages checks the same: a 400 naming the block).
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": role}}}, "then": _blocks(*kinds)}
        for role, kinds in (("user", ("text", "image", "tool_result")), ("system", ("text",)),
                            ("assistant", ("text", "tool_use", "thinking", "redacted_thinking")))]})
    role: Literal["user", "assistant", "system"]  # system: not Anthropic's, but Claude Code sends it
    content: str | list[Block]


class Tool(_Request):
    type: Literal["custom"] | None = None  # server tools (web search, ...) have other types: refused
    name: str
    description: str | None = None
    input_schema: dict
    strict: bool | None = None  # true: held to the whole schema or refused (tools compile leniently otherwise)


class ToolChoice(_Request):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ThinkingEnabled(_Request):
    # The OpenAPI document leaves it out for a model that does not reason (server/openapi.py).
    model_config = ConfigDict(json_schema_extra={WITHOUT_REASONING: {"not": {}}})
    type: Literal["enabled"]
    budget_tokens: Int = Field(ge=1024)


class ThinkingOther(_Request):
    type: Literal["adaptive", "disabled"]


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


def _default_effort(value: object) -> object:
    if value not in (None, "high"):
        raise ValueError("only effort high (the default) is supported by this server")
    return value


class OutputConfig(_Request):
    format: OutputFormat | None = None
    effort: Annotated[Literal["high"] | None, BeforeValidator(_default_effort)] = None


class ClearThinking(_Request):
    """The one context edit that changes nothing here: earlier thinking kept, all of it."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"]


class ContextManagement(_Request):
    edits: list[ClearThinking] = []


# tool_choice any or tool needs tools (and a named tool among them: a 400 otherwise)
_NEEDS_TOOLS = needs_tools({"required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}})
# output_config.format holds the reply to a schema, which a tool call could not keep to
_FORMAT_WITHOUT_TOOLS = no_constraint_with_tools(
    {"required": ["output_config"], "properties": {"output_config": not_null("format")}},
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    {"required": ["tool_choice"], "properties": {"tool_choice": {"type": "object", "required": ["type"],
                                                                 "properties": {"type": {"const": "none"}}}}})


class MessagesRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"allOf": [_NEEDS_TOOLS, _FORMAT_WITHOUT_TOOLS]})
    model: Annotated[str, WithJsonSchema({"type": "string", "x-model-name": True})]  # the served name (openapi.py)
    max_tokens: Int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, json_schema_extra=limit("maxItems", "max_stop_strings"))
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: bounded_int(ge=0) | None = None
    metadata: dict | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[ToolChoice | ToolChoiceTool, Field(discriminator="type")] | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    mcp_servers: unsupported("mcp_servers is not supported by this server") = None
    container: unsupported("containers are not supported by this server") = None
    context_management: ContextManagement | None = None


class CountTokensRequest(MessagesRequest):
    model_config = ConfigDict(json_schema_extra=_NEEDS_TOOLS)  # it renders the prompt; nothing is held to a format
    stop_sequences: list[str] | None = None  # not read by a count, so --max-stop-strings does not apply
    max_tokens: bounded_int(ge=1) | None = None  # not part of a count_tokens body


def chat_fields(body: MessagesRequest, reasons: bool) -> dict:
    """The ChatCompletionRequest fields of a Messages request; `reasons`: whether the model
    reasons (the server has a reasoning parser)."""
    fields = {"messages": to_messages(body.system, body.messages), "max_completion_tokens": body.max_tokens,
              "stream": body.stream, "stop": body.stop_sequences,
              **body.model_dump(include={"temperature", "top_p", "top_k"}, exclude_none=True)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {}),
            **({"strict": t.strict} if t.strict is not None else {})}}
            for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(body.tool_choice)
    if (thinking := _thinking(body, reasons)) is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return fields


def to_messages(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[dict]:
    """Chat messages for Anthropic's system and messages: a user turn's tool_result blocks become
    tool messages (before its text), an assistant turn's tool_use blocks its tool_calls."""
    out = [{"role": "system", "content": _text(system)}] if system else []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            if any(not isinstance(b, TextBlock) for b in m.content):
                raise APIError(400, f"messages.{i}: a system message holds text blocks only", f"messages.{i}.content")
            out.append({"role": "system", "content": _text(m.content)})
        else:
            out += _user(m.content, i) if m.role == "user" else [_assistant(m.content, i)]
    return out


def _user(blocks: list, i: int) -> list[dict]:
    results, parts = [], []
    for k, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append(b.chat_part())
        elif isinstance(b, ToolResultBlock):
            content = _text(b.content)
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {content}" if b.is_error else content})
        else:
            raise APIError(400, f"messages.{i}.content.{k}: a user message cannot hold a {b.type} block",
                           f"messages.{i}.content.{k}.type")
    if all(p["type"] == "text" for p in parts):  # text alone stays a string, as every template takes
        parts = "".join(p["text"] for p in parts)
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def _assistant(blocks: list, i: int) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for k, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            message["content"] += b.text
        elif isinstance(b, ThinkingBlock):
            message["reasoning_content"] = message.get("reasoning_content", "") + b.thinking
        elif isinstance(b, ToolUseBlock):
            message.setdefault("tool_calls", []).append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif isinstance(b, ToolResultBlock):
            raise APIError(400, f"messages.{i}.content.{k}: an assistant message cannot hold a tool_result block",
                           f"messages.{i}.content.{k}.type")
    return message


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _tool_choice(choice: ToolChoice | ToolChoiceTool) -> tuple[str | dict, bool]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls."""
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, False
    return {"any": "required"}.get(choice.type, choice.type), not choice.disable_parallel_tool_use


def _thinking(body: MessagesRequest, reasons: bool) -> bool | None:
    """Whether to ask the chat template for thinking (None: the template's default)."""
    if body.thinking is None:
        return None
    if not reasons:  # adaptive or disabled: a model that does not reason thinks in neither
        if isinstance(body.thinking, ThinkingEnabled):
            raise APIError(400, "this model does not think: thinking must be adaptive, disabled or left out",
                           "thinking")
        return None
    if body.thinking.type == "disabled":
        return False
    if isinstance(body.thinking, ThinkingEnabled) and body.max_tokens is not None \
            and body.thinking.budget_tokens >= body.max_tokens:
        raise APIError(400, "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
    return True
