"""What a request's `tools` and `tool_choice` ask for, whatever format the model writes calls in."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from vinoserve.server.errors import APIError


# Tool parameter schemas compile leniently (llguidance's JSON option): keywords it cannot enforce
# (propertyNames, uniqueItems, contains, if/then/else, not, ...) are left out of the constraint,
# with a warning in the log, rather than refusing the request. Agent clients (Claude Code, MCP
# servers) send them, and the client checks a call's arguments before it runs the tool. A tool
# marked `strict: true` is held to its whole schema or refused, as response_format is.
LENIENT = {"lenient": True}


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[dict, ...]  # the OpenAI function objects the model may call: name, description?, parameters?
    forced: bool  # "required" or a named function: a call must come, and finish_reason stays "stop"
    parallel: bool  # more than one call may come
    strict: tuple[dict, ...] = ()  # those of `functions` marked strict: true, checked without leniency

    def tools_variable(self) -> list[dict]:
        """The `tools` a chat template reads, in OpenAI's request shape."""
        return [{"type": "function", "function": f} for f in self.functions]


def tool_plan(req) -> ToolPlan | None:
    """From a request's `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI chat shapes); None
    when no call may be made. 400 naming the field for malformed ones."""
    tools, choice = req.tools or [], req.tool_choice
    functions = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tool {f['name']!r}: parameters must be a JSON schema object", "tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):  # 0 == False, yet not a boolean
            raise APIError(400, f"tool {f['name']!r}: strict must be a boolean", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise APIError(400, f"tool {f['name']!r}: description must be a string", "tools")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    strict = tuple(f for f, t in zip(functions, tools) if t["function"].get("strict"))
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none" or (choice == "auto" and not functions):  # no call can come either way
        return None
    if not functions:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if choice in ("auto", "required"):
        return ToolPlan(tuple(functions), choice == "required", req.parallel_tool_calls, strict)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise APIError(400, f"tool_choice must be none, auto, required or a function among tools; got {choice!r}",
                       "tool_choice")
    return ToolPlan(tuple(named), True, False, tuple(f for f in strict if f["name"] == name))


def call_schema(function: dict, arguments_key: str = "arguments") -> dict:
    """JSON schema of one call, {"name": <this function>, arguments_key: <its parameters>}."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def calls_schema(functions: tuple[dict, ...], arguments_key: str = "arguments") -> dict:
    """A call to any of `functions`: {"anyOf": [call_schema...]}, with the `$defs` their parameters
    declare moved to this root, where their `#/$defs/...` references resolve once the parameters are
    nested (pydantic's schemas use them), renamed per function so that two tools may use the
    same name."""
    defs: dict = {}
    calls = []
    for i, f in enumerate(functions):
        parameters = dict(f.get("parameters") or {})
        own = {**(parameters.pop("definitions", None) or {}), **(parameters.pop("$defs", None) or {})}
        if own:
            prefix = f"tool{i}."
            parameters = _renamed_refs(parameters, prefix)
            defs.update({prefix + name: _renamed_refs(d, prefix) for name, d in own.items()})
        calls.append(call_schema({**f, "parameters": parameters}, arguments_key))
    return {"anyOf": calls, **({"$defs": defs} if defs else {})}


def _renamed_refs(schema, prefix: str):
    """`schema` with its local references pointing at the root's `$defs`, names prefixed."""
    if isinstance(schema, list):
        return [_renamed_refs(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _renamed_refs(v, prefix) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for local in ("#/$defs/", "#/definitions/"):
            if ref.startswith(local):
                out["$ref"] = "#/$defs/" + prefix + ref[len(local):]
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
