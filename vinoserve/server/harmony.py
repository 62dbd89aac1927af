"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header, then a body,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the first message's `<|start|>assistant` is the prompt's end; the recipient `to=...` may also
come before the channel, as the chat template renders earlier calls: `<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>`). The tags are special tokens, so a reply
is read with special tokens kept in its text; `<|return|>` and `<|call|>` end it (stop tokens,
never in the text).

`HarmonyParser` reads one choice's reply as it streams. The analysis channel is reasoning, the final
(and a commentary preamble) is content. A message to a recipient is a tool call: with `calls` it
becomes ToolCallStart / ToolCallDelta events; without (the reasoning parser, which runs before
the tool parser) it is passed on in its raw form, `<|start|>HEADER<|message|>BODY<|call|>`, for
the tool parser, itself a HarmonyParser, to read.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import partial

from vinoserve.server.events import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_ENDS = (END, CALL, RETURN, START)  # what ends a body (a start: the model left out its end tag)
_OPENERS = ("<|", " to=", "to=")  # what a reply or a message after an end tag begins with, when not plain text
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


def lark_tag(text: str, special_tokens: Mapping[str, int]) -> str:
    """A harmony tag in an llguidance Lark grammar: its special token by id where it is one."""
    token = special_tokens.get(text)
    return f"<[{token}]>" if token is not None else f'"{text}"'


def analysis_rules(special_tokens: Mapping[str, int]) -> str:
    """Lark rules for `analysis`: one analysis message, `<|end|>` included, and `next`: the start of
    the message after it (the prompt already opened the first)."""
    tag = partial(lark_tag, special_tokens=special_tokens)
    if END in special_tokens:  # a special token never matches text: the free text ends where it comes
        think = f"THINK {tag(END)}\nTHINK: /(.|\\n)*/"
    else:
        think = f"think\nthink[suffix={tag(END)}]: /(?s:.*)/"
    return (f"analysis: {tag(CHANNEL)} \"analysis\" {tag(MESSAGE)} {think}\n"
            f"next: {tag(START)} \"assistant\"\n")


class HarmonyParser:
    """One choice's harmony reply, split as it arrives (see the module's doc). Text that may still
    be (part of) a tag is held back until decided."""

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        """`new_id`: the ids of the calls it reads; None passes calls on raw."""
        self.calls, self.new_id = new_id is not None, new_id
        self.mode = "open"  # "open": a header or plain text may come; "header"; "body"
        self.held = ""
        self.kind: type | None = TextDelta  # the body's events; None: a call's arguments (or raw call)
        self.made = 0  # calls announced

    @property
    def made_calls(self) -> bool:
        return self.made > 0

    def feed(self, text: str) -> list[Event]:
        self.held += text
        events: list[Event] = []
        while self.held:
            step = {"open": self._open, "header": self._header, "body": self._body}[self.mode]
            if not step(events):
                break
        return events

    def finish(self) -> list[Event]:
        """What was held back, once the reply has ended. A header cut short (at max_tokens) is
        dropped: it opened no message."""
        events: list[Event] = []
        if self.mode == "body":
            self._emit(events, self.held)
        elif self.mode == "open":
            events += _text(self.held)
        self.held = ""
        return events

    def _open(self, events: list[Event]) -> bool:
        """A header, when the text opens with a tag or a recipient; else plain content."""
        if any(self.held.startswith(o) for o in _OPENERS):
            self.mode = "header"
        elif any(o.startswith(self.held) for o in _OPENERS):
            return False
        else:
            self.mode, self.kind = "body", TextDelta
        return True

    def _header(self, events: list[Event]) -> bool:
        cut = self.held.find(MESSAGE)
        if cut < 0:
            return False
        header = self.held[:cut].removeprefix(START)
        self.held, self.mode = self.held[cut + len(MESSAGE):], "body"
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None and recipient.group(1) != "assistant":
            self.kind = None
            if self.calls:
                name = recipient.group(1).removeprefix("functions.")
                events.append(ToolCallStart(self.made, self.new_id(), name))
                self.made += 1
            else:
                events.append(TextDelta(START + header + MESSAGE))
        else:
            self.kind = ReasoningDelta if channel is not None and channel.group(1) == "analysis" else TextDelta
        return True

    def _body(self, events: list[Event]) -> bool:
        hits = [(i, tag) for tag in _ENDS if (i := self.held.find(tag)) >= 0]
        if not hits:
            keep = _partial_tag(self.held)
            self._emit(events, self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return False
        i, tag = min(hits)
        self._emit(events, self.held[:i])
        if self.kind is None and not self.calls:
            events.append(TextDelta(CALL if tag == START else tag))
        # A start tag opens the next header; after an end tag, plain text may follow (the content a
        # reasoning parser passed on) as well as the next message.
        self.held = self.held[i + (0 if tag == START else len(tag)):]
        self.mode = "header" if tag == START else "open"
        return True

    def _emit(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if self.kind is None:
            events.append(ToolCallDelta(self.made - 1, text) if self.calls else TextDelta(text))
        else:
            events.append(self.kind(text))


def _partial_tag(text: str) -> int:
    """Length of the end of `text` that may still grow into a tag."""
    i = text.rfind("<", max(0, len(text) - 10))
    if i < 0:
        return 0
    tail = text[i:]
    return len(tail) if any(t.startswith(tail) for t in _ENDS) else 0


def _text(text: str) -> list[Event]:
    return [TextDelta(text)] if text else []
