"""The generic tool-call format, for any chat template, the way llama.cpp's "Generic" does it.

The tools and a JSON reply format go into the system turn; a JSON-schema grammar then holds the
model to `{"tool_call": {"name", "arguments"}}` (or `{"tool_calls": [...]}` with parallel calls),
and under `auto` also to `{"response": "<text>"}`. Templates that render tools themselves get
`tools` as well; templates that do not get earlier calls and results as JSON text, so a
conversation with tool turns renders whatever the template. Replies stream as they are written:
a call's name once complete, then its arguments fragment by fragment, an answer's text as it grows.
"""
from __future__ import annotations

import json

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.events import Event, TextDelta, ToolCallDelta, ToolCallStart
from vinoserve.server.json_spans import JsonSpans, partial_string
from vinoserve.server.tools.format import ToolCallParser, ToolFormat, history_call, native_messages
from vinoserve.server.tools.plan import LENIENT, ToolPlan, calls_schema, new_call_id


class GenericFormat(ToolFormat):
    name = "generic"

    @classmethod
    def detect(cls, template: str) -> bool:
        return False  # the fallback, never detected

    def render(self, messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
        native = "tool_calls" in template
        out = native_messages(messages) if native else [_as_text(m) for m in messages]
        if plan is None:
            return out, {}
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{_instructions(plan)}"}
        else:
            out.insert(0, {"role": "system", "content": _instructions(plan)})
        return out, ({"tools": plan.tools_variable()} if native else {})

    def grammar(self, plan: ToolPlan) -> GrammarSpec:
        call = calls_schema(plan.functions)
        root = {"$defs": call.pop("$defs")} if "$defs" in call else {}  # referred to from the root
        root["x-guidance"] = LENIENT  # see tools/plan.py
        key, value = ("tool_calls", {"type": "array", "items": call, "minItems": 1}) if plan.parallel \
            else ("tool_call", call)
        calls = {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}
        if plan.forced:
            return GrammarSpec.json_schema({**calls, **root})
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return GrammarSpec.json_schema({"anyOf": [calls, answer], **root})

    def parser(self, plan: ToolPlan) -> GenericParser:
        return GenericParser(plan)


def _instructions(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions)
    call = ('{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}, ...]}' if plan.parallel
            else '{"tool_call": {"name": <tool name>, "arguments": <arguments object>}}')
    reply = f"Respond with a JSON object: {call} to call a tool"
    reply += "." if plan.forced else ', or {"response": <your answer>} to answer directly.'
    return f"You can call these tools:\n{listing}\n{reply}"


def _as_text(m: dict) -> dict:
    """A tool turn for a template that knows none: calls and results as this format's JSON."""
    if m.get("role") == "assistant" and m.get("tool_calls"):
        body = [{"name": n, "arguments": a} for n, a in map(history_call, m["tool_calls"])]
        text = {"tool_call": body[0]} if len(body) == 1 else {"tool_calls": body}
        return {"role": "assistant", "content": json.dumps(text, ensure_ascii=False)}
    if m.get("role") == "tool":
        result = {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content", "")}}
        return {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
    return {**m, "content": m.get("content", "")}


class GenericParser(ToolCallParser):
    """A constrained reply read as it arrives, through the spans of its JSON values. A reply cut
    short by max_tokens keeps its partial arguments, as OpenAI's does."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.json = plan, JsonSpans()
        self.sent_args: list[int] = []  # per call announced: characters of its arguments sent
        self.answer = ""  # the answer's text sent

    @property
    def made_calls(self) -> bool:
        return bool(self.sent_args)

    def feed(self, text: str) -> list[Event]:
        self.json.feed(text)
        if self.json.raw(("response",)) is not None:
            return self._answer_delta()
        events: list[Event] = []
        while (self.plan.parallel or not self.sent_args) and self.json.closed(self._call(len(self.sent_args)) + ("name",)):
            k = len(self.sent_args)
            self.sent_args.append(0)
            events.append(ToolCallStart(k, new_call_id(), json.loads(self.json.raw(self._call(k) + ("name",)))))
        for k, sent in enumerate(self.sent_args):
            args = self.json.raw(self._call(k) + ("arguments",)) or ""
            if len(args) > sent:
                events.append(ToolCallDelta(k, args[sent:]))
                self.sent_args[k] = len(args)
        return events

    def finish(self) -> list[Event]:
        """A reply that never became a call or an answer is passed on as text."""
        unread = not self.sent_args and self.json.raw(("response",)) is None
        return [TextDelta(self.json.text)] if unread and self.json.text else []

    def _call(self, k: int) -> tuple:
        return ("tool_calls", k) if self.plan.parallel else ("tool_call",)

    def _answer_delta(self) -> list[Event]:
        text = partial_string(self.json.raw(("response",)), self.json.closed(("response",)))
        new, self.answer = text[len(self.answer):], text
        return [TextDelta(new)] if new else []
