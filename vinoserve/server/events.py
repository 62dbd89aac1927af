"""Protocol-neutral events: what each choice's engine outputs become before any API renders them.

`server/event_stream.py` turns every engine output of every choice into one `Step`: the events
that output produced, in order. Reasoning and tool-call parsing happen there, once, so each API
module (completions, chat, and the Responses and Anthropic surfaces) only renders these events in
its own shape, once for a stream and once for a whole reply (`ChoiceResult`, built by `collect`):

    TextDelta        answer text ("content")
    ReasoningDelta   reasoning text, before the reasoning parser's end tag
    ToolCallStart    a tool call's id and name, as soon as the name is written
    ToolCallDelta    the next piece of that call's arguments (JSON text, concatenated in order)
    Logprobs         the step's tokens as OpenAI logprob entries, when the request asked
    PromptLogprobs   per prompt token (logprob, top, rank) as the engine scored them, first step only
    Finish           the choice ended: "stop", "length", "tool_calls" (a call made under auto), "abort"
and, after every choice has finished, one `Usage`.

With no parser in play a step holds exactly one TextDelta, empty when the token completed no
character yet: a stream then has one chunk per token, which clients time (inter-token latency).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    call_index: int  # 0, 1, ... within the choice
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    call_index: int
    arguments: str


@dataclass(frozen=True)
class Logprobs:
    entries: list[dict]  # {"token", "logprob", "bytes", "top_logprobs": [...]} per token


@dataclass(frozen=True)
class PromptLogprobs:
    scored: list  # per prompt token: None (the first) or (logprob, [(token, logprob)...], rank)


@dataclass(frozen=True)
class Finish:
    reason: str | None
    stop_string: str | None = None  # the request's stop string that ended it (Anthropic reports it)


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | Logprobs | PromptLogprobs | Finish


@dataclass(frozen=True)
class Step:
    """The events one engine output of choice `index` produced."""

    index: int
    events: tuple[Event, ...]

    def finish(self) -> Finish | None:
        return next((e for e in self.events if isinstance(e, Finish)), None)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its steps: what a non-streamed reply renders."""

    index: int
    text: str = ""
    reasoning: str | None = None  # None: no reasoning parser, or it saw none
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list | None = None
    had_text: bool = False  # some TextDelta arrived (an empty answer is "" rather than null)

    def add(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self.text += event.text
            self.had_text = True
        elif isinstance(event, ReasoningDelta):
            self.reasoning = (self.reasoning or "") + event.text
        elif isinstance(event, ToolCallStart):
            self.tool_calls.append(ToolCall(event.id, event.name))
        elif isinstance(event, ToolCallDelta):
            self.tool_calls[event.call_index].arguments += event.arguments
        elif isinstance(event, Logprobs):
            self.logprobs = (self.logprobs or []) + event.entries
        elif isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event.scored
        elif isinstance(event, Finish):
            self.finish_reason = event.reason
