"""The interface a tool-call format implements: one module per family of models (generic.py, ...).

A format says four things, and the server asks nothing else of it:

- `detect(template)`: whether a chat template belongs to this family (`--tool-call-parser auto`
  tries the registered formats in order, then falls back to generic);
- `render(messages, plan, template)`: the conversation ready for the chat template, with the tools
  declared (through the template's own `tools` variable, or as instructions in the system turn)
  and earlier calls and tool results in the form this family was trained on;
- `grammar(plan)`: the constraint on the reply: under `plan.forced` (tool_choice required or a
  named function) a call must come; otherwise (auto) text or a call (llguidance: a Lark grammar
  `start: TEXT | call` with the call's arguments as an inline `%json` schema, or a lazy rule that
  is free until the format's opening tag); None leaves the reply unconstrained;
- `parser(plan)`: a fresh `ToolCallParser` for one choice, which reads the reply as it streams and
  emits TextDelta / ToolCallStart / ToolCallDelta events (server/events.py). The raw tags never
  reach the client's text. A tag that is a special (control) token is dropped from the text unless
  the format sets `skip_special_tokens = False`; in a grammar, `<[id]>` names a token by id. The event stream turns a finish "stop" into "tool_calls" when a call
  was made under auto, as OpenAI does, for every format.

A reasoning model's reasoning is split off before the tool parser sees the text, and its grammar
is wrapped around the format's (server/reasoning.py), so formats need not know about reasoning.

Example, a format whose calls are `<call>{"name": ..., "arguments": ...}</call>`:

    class Tagged(ToolFormat):
        name = "tagged"

        @classmethod
        def detect(cls, template): return "<call>" in template

        def render(self, messages, plan, template):
            return native_messages(messages), {"tools": plan.tools_variable()} if plan else {}

        def grammar(self, plan):
            call = json.dumps({"anyOf": [call_schema(f) for f in plan.functions]})
            calls = f'"<call>" %json {call} "</call>"'
            return GrammarSpec("lark", f"start: {calls}" if plan.forced else
                               f"start: TEXT | {calls}\\nTEXT: /[^<](.|\\\\n)*/")

        def parser(self, plan): return TaggedParser(plan)

and its name added to FORMATS in tools/__init__.py. A format is built once per server with the
tokenizer's special tokens by text (`special_tokens`), so that it can tell whether a tag is one
token; the native formats (hermes.py, llama3.py, mistral.py) share native.py.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.events import Event
from vinoserve.server.tools.plan import ToolPlan


class ToolCallParser(ABC):
    """One choice's reply (after any reasoning), read piece by piece as the engine writes it."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The TextDelta / ToolCallStart / ToolCallDelta events that `text`, the next piece, completes."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for what is still held back when the reply ends (e.g. text that never became a call)."""

    @property
    @abstractmethod
    def made_calls(self) -> bool:
        """Whether any ToolCallStart was emitted."""


class ToolFormat(ABC):
    name: ClassVar[str]
    # False for a format whose calls open with a special token ([TOOL_CALLS], <|python_tag|>): the
    # engine then keeps special tokens in the text, so that the parser sees them.
    skip_special_tokens: bool = True

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        """`special_tokens`: the tokenizer's special (control) tokens by their text, for a format
        whose tags the model may write as one special token (named `<[id]>` in a grammar)."""
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    @abstractmethod
    def detect(cls, template: str) -> bool:
        """Whether `template` (the chat template's source) is of this format's family."""

    @abstractmethod
    def render(self, messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
        """Messages (OpenAI chat shape, content as text) for the template, and extra template
        variables. With plan None no tool is offered, but earlier tool turns must still render."""

    @abstractmethod
    def grammar(self, plan: ToolPlan) -> GrammarSpec | None:
        """The reply's constraint for this plan, or None for an unconstrained reply."""

    @abstractmethod
    def parser(self, plan: ToolPlan) -> ToolCallParser:
        """A fresh parser for one choice's reply."""


class JsonArguments(dict):
    """An earlier call's arguments as the object templates expect (`arguments|tojson`), which still
    reads as its JSON text where a template joins it to a string (DeepSeek-R1's `'...' + arguments`)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + str(self) if isinstance(other, str) else NotImplemented


def history_call(call: dict) -> tuple[str, object]:
    """(name, arguments) of an earlier call in a request's history; arguments parsed from their
    JSON text when they are one, as templates render `arguments|tojson` (vLLM does the same)."""
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # passed on as the text it is
    return f.get("name", ""), JsonArguments(args) if isinstance(args, dict) else args


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tool calls and tool turns itself: each call's
    arguments as an object, content "" rather than missing or null, and each tool result named
    after the call it answers (Hermes templates require `name`)."""
    out, names = [], {}
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": history_call(c)[1]}}
                               for c in m["tool_calls"]]
            names.update((c.get("id"), c["function"].get("name")) for c in m["tool_calls"])
        if m.get("role") == "tool" and m.get("tool_call_id") in names:
            m.setdefault("name", names[m["tool_call_id"]])
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out
