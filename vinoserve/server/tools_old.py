"""Tool calling for any chat template, the way llama.cpp's "Generic" format does it.

The tools and a JSON reply format go into a system message; a JSON-schema grammar then holds the
model to `{"tool_call": {"name", "arguments"}}` (or `{"tool_calls": [...]}` with parallel calls),
and under `auto` also to `{"response": "<text>"}`. Templates that render tools themselves get
`tools` as well; templates that do not get earlier calls and results as JSON text, so a
conversation with tool turns renders whatever the template. Replies stream as they are written
(`ToolReply`): a call's name once complete, then its arguments fragment by fragment.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.errors import APIError
from vinoserve.server.json_spans import JsonSpans, partial_string


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[dict, ...]  # the OpenAI function objects the model may call
    forced: bool  # "required" or a named function: a call must come, and finish_reason stays "stop"
    parallel: bool

    def grammar(self) -> GrammarSpec:
        call = {"anyOf": [_call_schema(f) for f in self.functions]}
        key, value = ("tool_calls", {"type": "array", "items": call, "minItems": 1}) if self.parallel \
            else ("tool_call", call)
        calls = {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}
        if self.forced:
            return GrammarSpec.json_schema(calls)
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return GrammarSpec.json_schema({"anyOf": [calls, answer]})

    def instructions(self) -> str:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions)
        call = ('{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}, ...]}' if self.parallel
                else '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}')
        reply = f"Respond with a JSON object: {call} to call a tool"
        reply += "." if self.forced else ', or {"response": <your answer>} to answer directly.'
        return f"You can call these tools:\n{listing}\n{reply}"


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_plan(req) -> ToolPlan | None:
    """What the request's tools and tool_choice ask for; None when no call may be made."""
    tools, choice = req.tools or [], req.tool_choice
    functions = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tool {f['name']!r}: parameters must be a JSON schema object", "tools")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if choice in ("auto", "required"):
        return ToolPlan(tuple(functions), choice == "required", req.parallel_tool_calls)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise APIError(400, f"tool_choice must be none, auto, required or a function among tools; got {choice!r}",
                       "tool_choice")
    return ToolPlan(tuple(named), True, False)


def render_messages(messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
    """Messages ready for the chat template, and the template's extra variables (tools)."""
    native = "tool_calls" in template
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [_call_from_history(c) for c in m["tool_calls"]]
            if native:  # templates render `arguments|tojson`, so they want objects (as vLLM passes them)
                m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": a}}
                                   for c, (_, a) in zip(m["tool_calls"], calls)]
                m.setdefault("content", "")
            else:
                body = [{"name": n, "arguments": a} for n, a in calls]
                text = {"tool_call": body[0]} if len(body) == 1 else {"tool_calls": body}
                m = {"role": "assistant", "content": json.dumps(text, ensure_ascii=False)}
        elif m.get("role") == "tool" and not native:
            result = {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content", "")}}
            m = {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
        m.setdefault("content", "")
        out.append(m)
    if plan is None:
        return out, {}
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{plan.instructions()}"}
    else:
        out.insert(0, {"role": "system", "content": plan.instructions()})
    return out, ({"tools": [{"type": "function", "function": f} for f in plan.functions]} if native else {})


def _call_from_history(call: dict) -> tuple[str, object]:
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # passed on as the text it is
    return f.get("name", ""), args


class ToolReply:
    """A constrained reply read as it arrives: a call's id and name are sent once the name is
    written, its arguments in the fragments the model writes them, an answer's text as it grows.
    The whole message is built from the same reading, so a stream reassembles into it exactly
    (a reply cut short by max_tokens keeps its partial arguments, as OpenAI's does)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.json = plan, JsonSpans()
        self.ids: list[str] = []  # calls announced so far
        self.sent_args: list[int] = []  # characters of each call's arguments sent
        self.answer = ""  # the answer's text sent

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the reply's next piece, completes."""
        self.json.feed(text)
        if self.json.raw(("response",)) is not None:
            return self._answer_delta()
        deltas = []
        while (self.plan.parallel or not self.ids) and self.json.closed(self._call(len(self.ids)) + ("name",)):
            k = len(self.ids)
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
            self.sent_args.append(0)
            name = json.loads(self.json.raw(self._call(k) + ("name",)))
            deltas.append({"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})
        for k in range(len(self.ids)):
            args = self.json.raw(self._call(k) + ("arguments",)) or ""
            if len(args) > self.sent_args[k]:
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": args[self.sent_args[k]:]}}]})
                self.sent_args[k] = len(args)
        return deltas

    def finish(self) -> list[dict]:
        """Deltas at the end: a reply that never became a call or an answer is passed on as text."""
        return [{"content": self.json.text}] if self._unread() and self.json.text else []

    def message(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message for everything fed, and its finish_reason."""
        if self._unread():
            return {"role": "assistant", "content": self.json.text}, finish_reason
        if not self.ids:
            return {"role": "assistant", "content": self.answer}, finish_reason
        calls = [{"id": call_id, "type": "function",
                  "function": {"name": json.loads(self.json.raw(self._call(k) + ("name",))),
                               "arguments": self.json.raw(self._call(k) + ("arguments",)) or ""}}
                 for k, call_id in enumerate(self.ids)]
        forced_or_cut = self.plan.forced or finish_reason != "stop"
        return {"role": "assistant", "content": None, "tool_calls": calls}, \
            finish_reason if forced_or_cut else "tool_calls"

    def _call(self, k: int) -> tuple:
        return ("tool_calls", k) if self.plan.parallel else ("tool_call",)

    def _unread(self) -> bool:
        return not self.ids and self.json.raw(("response",)) is None

    def _answer_delta(self) -> list[dict]:
        text = partial_string(self.json.raw(("response",)), self.json.closed(("response",)))
        new, self.answer = text[len(self.answer):], text
        return [{"content": new}] if new else []
