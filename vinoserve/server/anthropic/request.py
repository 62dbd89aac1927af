"""A POST /v1/messages body: validated here, then converted into a chat request's fields.

Honoured: system (a string or text blocks), messages with text, tool_use, tool_result (content
as a string or text blocks; is_error marks the result as an error) and thinking blocks, tools
(name, description, input_schema), tool_choice (auto, any, tool, none;
disable_parallel_tool_use), stop_sequences, max_tokens, temperature, top_p, top_k, metadata,
thinking (enabled / adaptive / disabled turn a reasoning model's thinking on or off through its
chat template; budget_tokens is checked, and bounded only by max_tokens), output_config.format
(a JSON schema the answer is held to). Refused with a 400: images, documents, server tools
(web search, code execution, ...), MCP servers, containers, output_config.effort, and thinking on
a model that does not reason.
"""
from __future__ import annotations

import json

from pydantic import Field

from vinoserve.server.errors import APIError
from vinoserve.server.protocol import Int, _Request

_REFUSED_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                   "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload")


class MessagesRequest(_Request):
    model: str
    max_tokens: Int = Field(ge=1)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0)
    metadata: dict | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    mcp_servers: list | None = None
    container: str | dict | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Int | None = Field(None, ge=1)  # not part of a count_tokens body


def chat_fields(body: MessagesRequest, reasons: bool) -> dict:
    """The ChatCompletionRequest fields of a Messages request; `reasons`: whether the model
    reasons (the server has a reasoning parser)."""
    for param, given in (("mcp_servers", body.mcp_servers), ("container", body.container)):
        if given:
            raise APIError(400, f"{param} is not supported by this server", param)
    fields = {"messages": to_messages(body.system, body.messages), "max_completion_tokens": body.max_tokens,
              "stream": body.stream, "stop": body.stop_sequences,
              **body.model_dump(include={"temperature", "top_p", "top_k"}, exclude_none=True)}
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(body.tool_choice)
    if (thinking := _thinking(body.thinking, body.max_tokens, reasons)) is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    if (fmt := _output_format(body.output_config)) is not None:
        fields["response_format"] = fmt
    return fields


def to_messages(system: str | list[dict] | None, messages: list[dict]) -> list[dict]:
    """Chat messages for Anthropic's system and messages: a user turn's tool_result blocks become
    tool messages (before its text), an assistant turn's tool_use blocks its tool_calls."""
    out = [{"role": "system", "content": system if isinstance(system, str) else _text(system, "system")}] \
        if system else []
    for i, m in enumerate(messages):
        param = f"messages.{i}"
        if not isinstance(m, dict):
            raise APIError(400, f"{param} must be a message object", param)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{param}.role must be user or assistant; got {role!r}", f"{param}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise APIError(400, f"{param}.content must be a string or a list of content blocks", f"{param}.content")
        else:
            out += _user(content, param) if role == "user" else [_assistant(content, param)]
    return out


def _user(blocks: list, param: str) -> list[dict]:
    results, text = [], []
    for k, b in enumerate(blocks):
        kind = _kind(b, f"{param}.content.{k}")
        if kind == "text":
            text.append(_block_text(b, f"{param}.content.{k}"))
        elif kind == "tool_result":
            content = b.get("content", "")
            content = content if isinstance(content, str) else _text(content, f"{param}.content.{k}.content")
            if not isinstance(b.get("tool_use_id"), str):
                raise APIError(400, f"{param}.content.{k}.tool_use_id must be a string", f"{param}.content.{k}")
            if b.get("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        else:
            _refuse(kind, f"{param}.content.{k}")
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _assistant(blocks: list, param: str) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for k, b in enumerate(blocks):
        where = f"{param}.content.{k}"
        kind = _kind(b, where)
        if kind == "text":
            message["content"] += _block_text(b, where)
        elif kind == "thinking":
            message["reasoning_content"] = message.get("reasoning_content", "") + str(b.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # another model's encrypted reasoning: nothing this one can read
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input", {}), dict):
                raise APIError(400, f"{where}: a tool_use block needs a string id and name and an object input",
                               where)
            call = {"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}}
            message.setdefault("tool_calls", []).append(call)
        else:
            _refuse(kind, where)
    return message


def _kind(block: object, param: str) -> str | None:
    if not isinstance(block, dict):
        raise APIError(400, f"{param} must be a content block object", param)
    return block.get("type")


def _block_text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{param}.text must be a string", f"{param}.text")
    return block["text"]


def _text(blocks: object, param: str) -> str:
    """The text of a list of text blocks (a system prompt, a tool result)."""
    if not isinstance(blocks, list):
        raise APIError(400, f"{param} must be a string or a list of text blocks", param)
    for k, b in enumerate(blocks):
        if _kind(b, f"{param}.{k}") != "text":
            _refuse(b.get("type"), f"{param}.{k}")
    return "".join(_block_text(b, f"{param}.{k}") for k, b in enumerate(blocks))


def _refuse(kind: str | None, param: str) -> None:
    why = "this server serves a text model" if kind in ("image", "document") else \
        "server tools are not supported" if kind in _REFUSED_BLOCKS else "unknown block type"
    raise APIError(400, f"{param}: content blocks of type {kind!r} are not supported ({why})", f"{param}.type")


def _tool(tool: dict, i: int) -> dict:
    if tool.get("type", "custom") != "custom":
        raise APIError(400, f"tools.{i}: tools of type {tool['type']!r} are not supported (server tools); this server "
                            "runs client tools with an input_schema only", f"tools.{i}.type")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise APIError(400, f"tools.{i} needs a string name and an input_schema object", f"tools.{i}")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict) -> tuple[str | dict, bool]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls."""
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, False
    raise APIError(400, "tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def _thinking(thinking: dict | None, max_tokens: int | None, reasons: bool) -> bool | None:
    """Whether to ask the chat template for thinking (None: the template's default)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise APIError(400, "thinking.type must be enabled, adaptive or disabled", "thinking.type")
    if not reasons:
        raise APIError(400, "this model does not think: thinking must be disabled or left out", "thinking")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and not (isinstance(budget, int) and 1024 <= budget < (max_tokens or budget + 1)):
        raise APIError(400, "thinking.budget_tokens must be at least 1024 and less than max_tokens",
                       "thinking.budget_tokens")
    return True


def _output_format(config: dict | None) -> dict | None:
    if not config:
        return None
    if config.get("effort") is not None:
        raise APIError(400, "output_config.effort is not supported by this server", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
