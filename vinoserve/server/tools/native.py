"""What the native tool-call formats (hermes.py, llama3.py, mistral.py) share. Each family writes
its calls as JSON after an opening tag: the chat template tells the model how (it renders the
tools, earlier calls and results itself), the grammar holds it to that and to the tools' schemas,
and `NativeParser` reads the calls back out of the text as it streams.

A tag is matched as text; where the tokenizer has it as one special token (`[TOOL_CALLS]`,
`<|python_tag|>`), the grammar names that token by id and the format keeps special tokens in
the text (`skip_special_tokens = False`), so that the parser sees the tag.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from vinoserve.scheduler.grammar import JSON_STYLE, GrammarSpec
from vinoserve.server.events import Event, TextDelta, ToolCallDelta, ToolCallStart
from vinoserve.server.json_spans import JsonSpans
from vinoserve.server.reasoning import partial_suffix
from vinoserve.server.tools.format import ToolCallParser, ToolFormat, native_messages
from vinoserve.server.tools.plan import LENIENT, ToolPlan, new_call_id

# Free text in an auto reply; llguidance never lets a special token match it.
TEXT = "TEXT: /(.|\\n)*/"


@dataclass(frozen=True)
class Tag:
    text: str
    token: int | None = None  # the special token that writes it; None: written as text

    def lark(self) -> str:
        return f"<[{self.token}]>" if self.token is not None else json.dumps(self.text)


@dataclass(frozen=True)
class CallSyntax:
    """Where a family's calls begin in a reply, and how their JSON is laid out."""

    opening: tuple[str, ...]  # texts that open the calls (dropped from the reply)
    leading: bool = False  # calls only at the very start of a reply (else after any text)
    bare_json: bool = False  # a reply that starts with "{" is a call without an opening tag
    array: bool = False  # the calls are one JSON array (else one object per call)
    arguments: tuple[str, ...] = ("arguments",)  # the keys a call's arguments may come under


def json_rule(schema: dict) -> str:
    """A Lark `%json` rule for a tool call's `schema`, JSON written as everywhere else in the server,
    compiled leniently (see tools/plan.py)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, **LENIENT}})


def tagged_grammar(opening: Tag, calls: str, rules: str, forced: bool) -> GrammarSpec:
    """`opening` then `calls` (a Lark expression over `rules`). Forced: nothing else. Auto: free text,
    which ends where the opening is first written, and the calls follow; or text alone."""
    if forced:
        return GrammarSpec("lark", f"start: {opening.lark()} {calls}\n{rules}")
    if opening.token is not None:  # a special token: never part of TEXT
        start = f"start: TEXT | TEXT {opening.lark()} {calls}"
    else:  # text: a lazy lexeme ends at the opening's first appearance, so TEXT cannot hold it
        start = f"start: TEXT | head {calls}\nhead[lazy]: TEXT {opening.lark()}"
    return GrammarSpec("lark", f"{start}\n{rules}\n{TEXT}")


class NativeFormat(ToolFormat):
    """A family whose chat template renders the tools and earlier calls and results itself."""

    syntax: CallSyntax

    def tag(self, text: str) -> Tag:
        """`text` as this tokenizer writes it; a special token keeps special tokens in the text."""
        tag = Tag(text, self.special_tokens.get(text))
        if tag.token is not None:
            self.skip_special_tokens = False
        return tag

    def render(self, messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
        return native_messages(messages), ({"tools": plan.tools_variable()} if plan else {})

    def parser(self, plan: ToolPlan) -> NativeParser:
        return NativeParser(self.syntax, self.new_id)

    @staticmethod
    def new_id() -> str:
        return new_call_id()


class NativeParser(ToolCallParser):
    """Text until an opening tag, then calls. Text that may still become an opening is held back,
    and so is whitespace, which is dropped right before a call (templates write their own
    separator there). A call's name is sent once whole, its arguments as they grow."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str]) -> None:
        self.syntax = syntax
        self.mode = "start" if syntax.leading else "text"  # then "text" or "calls"
        self.held = ""
        self.calls = _Calls(syntax, new_id)

    @property
    def made_calls(self) -> bool:
        return bool(self.calls.sent)

    def feed(self, text: str) -> list[Event]:
        if self.mode == "calls":
            return self.calls.feed(text)
        self.held += text
        if self.mode == "start":
            return self._start()
        if not self.syntax.leading:
            return self._text()
        text, self.held = self.held, ""
        return _text(text)

    def finish(self) -> list[Event]:
        """Text held back that never became a call is text after all."""
        if self.mode == "calls":
            return []
        text, self.held = self.held, ""
        return _text(text)

    def _start(self) -> list[Event]:
        """A reply that may only begin with its calls: decided by its first characters."""
        for tag in self.syntax.opening:
            if self.held.startswith(tag):
                return self._open(self.held[len(tag):])
            if tag.startswith(self.held):
                return []  # may still become the tag
        if self.syntax.bare_json and self.held.startswith("{"):
            return self._open(self.held)
        self.mode = "text"
        return self.feed("")

    def _text(self) -> list[Event]:
        hits = [(i, tag) for tag in self.syntax.opening if (i := self.held.find(tag)) >= 0]
        if hits:
            i, tag = min(hits)
            before = self.held[:i].rstrip()
            return _text(before) + self._open(self.held[i + len(tag):])
        keep = max(partial_suffix(self.held, tag) for tag in self.syntax.opening)
        cut = len(self.held[:len(self.held) - keep].rstrip())
        out, self.held = self.held[:cut], self.held[cut:]
        return _text(out)

    def _open(self, rest: str) -> list[Event]:
        self.mode, self.held = "calls", ""
        return self.calls.feed(rest)


class _Calls:
    """The calls' JSON values, read as they arrive; what lies between values (closing and
    opening tags, separators) is skipped."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str]) -> None:
        self.syntax, self.new_id = syntax, new_id
        self.json: JsonSpans | None = None  # the value being read
        self.first = 0  # the index of the value's first call
        self.sent: list[int] = []  # per call announced: characters of its arguments sent

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self.json is None:
                i = text.find("[" if self.syntax.array else "{")
                if i < 0:
                    break
                text, self.json = text[i:], JsonSpans()
            self.json.feed(text)
            events += self._progress()
            if not self.json.closed(()):
                break
            text = self.json.text[self.json.spans[()][1]:]
            self.json, self.first = None, len(self.sent)
        return events

    def _call(self, k: int) -> tuple:
        """The path of the value's k-th call."""
        return (k,) if self.syntax.array else ()

    def _progress(self) -> list[Event]:
        events: list[Event] = []
        while self.syntax.array or len(self.sent) == self.first:
            name = self._call(len(self.sent) - self.first) + ("name",)
            if not self.json.closed(name):
                break
            events.append(ToolCallStart(len(self.sent), self.new_id(), json.loads(self.json.raw(name))))
            self.sent.append(0)
        for i in range(self.first, len(self.sent)):
            path = self._call(i - self.first)
            args = next((a for key in self.syntax.arguments if (a := self.json.raw(path + (key,))) is not None), "")
            if len(args) > self.sent[i]:
                events.append(ToolCallDelta(i, args[self.sent[i]:]))
                self.sent[i] = len(args)
        return events


def _text(text: str) -> list[Event]:
    return [TextDelta(text)] if text else []

