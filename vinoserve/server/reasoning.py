"""Reasoning models: the text they think in, split from their answer, and kept out of constraints.

DeepSeek-R1 and Qwen3 write `<think>reasoning</think>answer`. The chat template may already have
opened `<think>` in the prompt (DeepSeek-R1 distills, Qwen3 with thinking on in newer templates),
or closed an empty one (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`), so where
the reasoning stands when generation starts is read from the prompt's end (`ReasoningFormat.start_state`),
as llama.cpp and vLLM do. Then:

- `ReasoningFormat.parser(state)` gives each choice a `ReasoningParser`, which sends the text up to
  the end tag as ReasoningDelta events and the rest as TextDelta (the tool parser reads only those);
- `ReasoningFormat.constrain(grammar, state)` lets a response_format or tool grammar hold only what
  follows the reasoning: an llguidance grammar whose first rule takes any text up to the end tag
  (`suffix=`, so no token is ever taken back), then the request's own grammar.

`--reasoning-parser` names one of FORMATS, `none`, or `auto`: the first format whose `detect`
accepts the chat template, else none. The tags are matched as text, so they work whether the
tokenizer has them as single (non-special) tokens or spells them out.

gpt-oss reasons in OpenAI's harmony format instead (harmony.py): `HarmonyReasoning`, whose tags are
special tokens, kept in the text for its parser and named by id in its grammar.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.events import Event, ReasoningDelta, TextDelta
from vinoserve.server.harmony import (CHANNEL, CONSTRAIN, END, MESSAGE, TAGS, HarmonyParser, analysis_rules,
                                      lark_tag)


class Start(Enum):
    OPEN = "open"  # the prompt ends inside the reasoning block: the output reasons first
    CLOSED = "closed"  # the prompt ends after a closed block: the output is all answer
    UNOPENED = "unopened"  # no block yet: the output may open one, first thing


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    marker: str  # detection: a chat template of this family contains it
    start: str = "<think>"
    end: str = "</think>"
    # DeepSeek-R1: text before the end tag is reasoning even when no start tag was seen (its older
    # templates leave `<think>` to the model, which sometimes leaves it out).
    implicit: bool = False
    # False for tags that are special tokens: the engine then keeps them in the text for the parser.
    skip_special_tokens: bool = True

    def with_special_tokens(self, special_tokens: Mapping[str, int]) -> ReasoningFormat:
        """This format for a tokenizer with these special tokens (by text)."""
        return self

    def detect(self, template: str) -> bool:
        return self.start in template and self.marker in template

    def start_state(self, prompt_text: str) -> Start:
        tail = prompt_text.rstrip()
        if tail.endswith(self.start):
            return Start.OPEN
        if tail.endswith(self.end):
            return Start.CLOSED
        return Start.OPEN if self.implicit else Start.UNOPENED

    def parser(self, state: Start) -> ReasoningParser | HarmonyParser:
        return ReasoningParser(self, state)

    def constrain(self, inner: GrammarSpec, state: Start, tools: bool = False) -> GrammarSpec:
        """`inner` held to the answer only: any reasoning first, up to and including the end tag.
        `tools`: `inner` is the tool format's grammar."""
        if state is Start.CLOSED:
            return inner
        # A little whitespace may follow the end tag (Qwen3 writes "\n\n"); unbounded, a small model
        # can spend its whole budget on it, as with JSON's own whitespace (scheduler/grammar.py).
        rules = f"think[suffix={json.dumps(self.end)}]: /(?s:.*)/\nWS: /[ \\t\\r\\n]{{1,4}}/\n"
        if state is Start.OPEN:
            return GrammarSpec.composed(f"start: think WS? @inner\n{rules}", inner)
        return GrammarSpec.composed(f"start: (WS? {json.dumps(self.start)} think WS?)? @inner\n{rules}", inner)


@dataclass(frozen=True)
class HarmonyReasoning(ReasoningFormat):
    """gpt-oss: reasoning is the analysis channel's messages, the answer the final channel's."""

    special_tokens: tuple[tuple[str, int], ...] = ()  # the harmony tags that are special tokens

    def with_special_tokens(self, special_tokens: Mapping[str, int]) -> HarmonyReasoning:
        return replace(self, special_tokens=tuple((t, special_tokens[t]) for t in TAGS if t in special_tokens))

    def detect(self, template: str) -> bool:
        return self.start in template

    def start_state(self, prompt_text: str) -> Start:
        return Start.UNOPENED  # the prompt ends `<|start|>assistant`: a channel comes first

    def parser(self, state: Start) -> HarmonyParser:
        return HarmonyParser()

    def constrain(self, inner: GrammarSpec, state: Start, tools: bool = False) -> GrammarSpec:
        """One analysis message at most first (as for forced calls, tools/harmony.py), then `inner`
        as the final message's body; the harmony tool grammar
        frames its messages itself (tools/harmony.py), reasoning included."""
        if tools:
            return inner
        special = dict(self.special_tokens)
        tag = partial(lark_tag, special_tokens=special)
        final = f'{tag(CHANNEL)} "final" (" "? {tag(CONSTRAIN)}? "json")? {tag(MESSAGE)}'
        return GrammarSpec.composed(f"start: (analysis next)? {final} @inner\n{analysis_rules(special)}", inner)


# Both tag families write the same tags; they differ in what an output without a start tag means.
FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", marker="｜Assistant｜", implicit=True),
    ReasoningFormat("qwen3", marker="</think>"),
    HarmonyReasoning("harmony", marker=CHANNEL, start=CHANNEL + "analysis" + MESSAGE, end=END,
                     skip_special_tokens=False),
)}
CHOICES = ("auto", *FORMATS, "none")


def select_reasoning(name: str, template: str, special_tokens: Mapping[str, int] | None = None
                     ) -> ReasoningFormat | None:
    """The format `--reasoning-parser NAME` means for a model with this chat template and these
    special tokens (by text)."""
    if name == "auto":
        found = next((f for f in FORMATS.values() if f.detect(template)), None)
    elif name == "none":
        return None
    elif name not in FORMATS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(CHOICES)}; got {name!r}")
    else:
        found = FORMATS[name]
    return found.with_special_tokens(special_tokens or {}) if found is not None else None


class ReasoningParser:
    """One choice's output split as it arrives. Text that may still turn out to be (part of) a
    tag is held back until it is decided; whitespace between the end tag and the answer is dropped."""

    def __init__(self, fmt: ReasoningFormat, state: Start) -> None:
        self.fmt = fmt
        self.mode = {Start.OPEN: "reasoning", Start.CLOSED: "content", Start.UNOPENED: "undecided"}[state]
        self.leading = state is not Start.CLOSED  # a start tag may still come first (it is dropped)
        self.held = ""
        self.trim = False  # right after the end tag

    def feed(self, text: str) -> list[Event]:
        self.held += text
        events: list[Event] = []
        while self.held:
            if self.leading and not self._leading_tag():
                break
            if self.mode == "reasoning":
                cut = self.held.find(self.fmt.end)
                if cut < 0:
                    keep = partial_suffix(self.held, self.fmt.end)
                    self._emit(events, ReasoningDelta, len(self.held) - keep)
                    break
                self._emit(events, ReasoningDelta, cut)
                self.held = self.held[len(self.fmt.end):]
                self.mode, self.trim = "content", True
                continue
            if self.trim:
                self.held = self.held.lstrip()
                self.trim = not self.held
            self._emit(events, TextDelta, len(self.held))
        return events

    def finish(self) -> list[Event]:
        """What was held back, once the output has ended."""
        if self.mode == "reasoning" and self.held:
            return [ReasoningDelta(self.held)]
        text = self.held.lstrip() if self.trim else self.held
        return [TextDelta(text)] if text else []

    def _leading_tag(self) -> bool:
        """Consumes a start tag at the very beginning; False while the text could still become one."""
        lead = self.held.lstrip()
        if lead.startswith(self.fmt.start):
            self.held, self.mode = lead[len(self.fmt.start):], "reasoning"
        elif self.fmt.start.startswith(lead):
            return False
        elif self.mode == "undecided":
            self.mode = "content"
        self.leading = False
        return True

    def _emit(self, events: list[Event], kind: type, n: int) -> None:
        if n > 0:
            events.append(kind(self.held[:n]))
        self.held = self.held[n:]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
