"""A Responses request's `tools` as the function tools the model is offered.

- `function` tools are offered as they are.
- `namespace` tools (a group of functions under one name, as Codex CLI sends its sub-agent tools
  and MCP servers) are flattened: each function is offered as `{namespace}__{name}`, the
  namespace's description before its own. A call the model makes to a flattened name comes back
  as OpenAI returns it, `name` and `namespace` apart (Codex routes on the pair), and a
  `function_call` item sent back with a `namespace` is rendered under the flattened name again.
  Only names built from this request's namespaces are split, so `get__weather` stays whole.
- Built-in tools that OpenAI runs on its own servers (web search, file search, code interpreter,
  image generation, remote MCP) cannot run here. They are accepted, never offered to the model,
  and said so: a warning in the log and in the reply's `Warning` header. tool_choice cannot
  force one (a 400). Tools the client runs that need more than a function call (custom, shell,
  computer use, ...) stay refused by the request's schema (server/responses/schema.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vinoserve.server.errors import APIError

log = logging.getLogger("vinoserve.responses")
SEPARATOR = "__"  # vLLM's and Codex's own MCP naming (mcp__server__tool)
_warned: set[str] = set()  # built-in tool types already named in the log at warning level


@dataclass(frozen=True)
class OfferedTools:
    chat: list[dict] = field(default_factory=list)  # chat-shaped function tools, as the model sees them
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)
    not_offered: tuple[str, ...] = ()  # built-in tool types accepted but not offered

    def split(self, flat: str) -> tuple[str | None, str]:
        """A called name as (namespace, name): namespace None for a plain function."""
        return self.namespaced.get(flat, (None, flat))

    def warning(self) -> str | None:
        """The reply's Warning header (RFC 9110's 299 "miscellaneous persistent warning")."""
        if not self.not_offered:
            return None
        return f'299 vinoserve "built-in tools not offered to the model (this server cannot run them): ' \
               f'{", ".join(self.not_offered)}"'


def flat_name(namespace: str | None, name: str) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def offered_tools(tools: list) -> OfferedTools:
    """From validated tools (server/responses/schema.py's Tool); 400 where two offered names clash."""
    chat, namespaced, not_offered = [], {}, []
    for tool in tools:
        if tool.type == "function":
            chat.append(_chat_tool(tool, tool.name))
        elif tool.type == "namespace":
            for fn in tool.tools:
                flat = flat_name(tool.name, fn.name)
                namespaced[flat] = (tool.name, fn.name)
                chat.append(_chat_tool(fn, flat, tool.description))
        elif tool.type not in not_offered:
            not_offered.append(tool.type)
    names = [t["function"]["name"] for t in chat]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise APIError(400, f"tool names must be unique once namespaces are flattened ({{namespace}}{SEPARATOR}"
                            f"{{name}}): {', '.join(dup)}", "tools")
    if not_offered:
        level = logging.INFO if set(not_offered) <= _warned else logging.WARNING
        _warned.update(not_offered)
        log.log(level, "built-in tools not offered to the model (this server cannot run them): %s",
                ", ".join(not_offered))
    return OfferedTools(chat, namespaced, tuple(not_offered))


def _chat_tool(fn, name: str, namespace_description: str | None = None) -> dict:
    function = {"name": name, **fn.model_dump(include={"description", "parameters", "strict"}, exclude_none=True)}
    if namespace_description:
        function["description"] = "\n\n".join(filter(None, [namespace_description, function.get("description")]))
    return {"type": "function", "function": function}
