"""The event stream of one reply as Anthropic's Message and its streamed events (message_start,
ping, content_block_start / _delta / _stop, message_delta, message_stop). A whole reply is the same
builder with its events dropped, so a stream reassembles into exactly the reply it would have been.

Reasoning becomes a `thinking` block (with an empty signature: nothing here signs it), answer text
a `text` block, each tool call a `tool_use` block whose input streams as input_json_delta.
Ids carry Anthropic's prefixes (`msg_`, `toolu_`): clients and SDK helpers match on them."""
from __future__ import annotations

import copy
import json
import uuid

from vinoserve.server.anthropic.errors import anthropic_error
from vinoserve.server.errors import failure
from vinoserve.server.events import Finish, ReasoningDelta, Step, TextDelta, ToolCallDelta, ToolCallStart, Usage

Event = tuple[str, dict]  # (event name, data)


def anthropic_id(prefix: str) -> str:
    """As Anthropic spells them: `msg_...`, `toolu_...` (an underscore, where OpenAI's have a dash)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessageBuilder:
    def __init__(self, message_id: str, model: str, prompt_tokens: int, context_bound: bool = False) -> None:
        """`context_bound`: the context, not max_tokens, limits the reply's length."""
        self.message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        self.open: tuple | None = None  # ("thinking",), ("text",) or ("call", k)
        self.calls: dict[int, int] = {}  # a call's index -> its block's index
        self.arguments: dict[int, str] = {}  # a tool_use block's index -> its input's JSON text so far
        self.finish = Finish(None)
        self.context_bound = context_bound

    @property
    def content(self) -> list[dict]:
        return self.message["content"]

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": copy.deepcopy(self.message)}),
                ("ping", {"type": "ping"})]

    def step(self, step: Step) -> list[Event]:
        events: list[Event] = []
        for e in step.events:
            if isinstance(e, ReasoningDelta) and e.text:
                events += self._switch(("thinking",))
                self.content[-1]["thinking"] += e.text
                events.append(self._delta(len(self.content) - 1, {"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, TextDelta) and e.text:
                events += self._switch(("text",))
                self.content[-1]["text"] += e.text
                events.append(self._delta(len(self.content) - 1, {"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallStart):
                events += self._switch(("call", e.call_index), e)
            elif isinstance(e, ToolCallDelta) and e.arguments:
                index = self.calls[e.call_index]
                self.arguments[index] += e.arguments
                events.append(self._delta(index, {"type": "input_json_delta", "partial_json": e.arguments}))
            elif isinstance(e, Finish):
                self.finish = e
        return events

    def done(self, usage: Usage) -> list[Event]:
        """The reply has ended: its last block closes, then message_delta (stop_reason, usage) and
        message_stop. As Anthropic counts them, input_tokens leaves out the prompt tokens read
        from the (prefix) cache, which cache_read_input_tokens counts."""
        events = self._close()
        reason, stop = self.finish.reason, None
        if self.calls and reason in ("stop", "tool_calls"):
            reason = "tool_use"
        elif reason == "length":
            reason = "model_context_window_exceeded" if self.context_bound else "max_tokens"
        elif reason == "stop" and self.finish.stop_string is not None:
            reason, stop = "stop_sequence", self.finish.stop_string
        else:
            reason = "end_turn"
        counts = {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
                  "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}
        self.message.update(stop_reason=reason, stop_sequence=stop, usage=counts)
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": stop},
                                            "usage": dict(counts)}),
                         ("message_stop", {"type": "message_stop"})]

    def failed(self, error: Exception) -> list[Event]:
        """A failure after the stream began: Anthropic's `error` event."""
        status, message, _ = failure(error)
        return [("error", anthropic_error(status, message))]

    def _switch(self, key: tuple, call: ToolCallStart | None = None) -> list[Event]:
        if self.open == key:
            return []
        events = self._close()
        self.open, index = key, len(self.content)
        if key[0] == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif key[0] == "text":
            block = {"type": "text", "text": ""}
        else:
            self.calls[call.call_index], self.arguments[index] = index, ""
            # The tool format's own id (call_..., Mistral's 9 characters) is not Anthropic's.
            block = {"type": "tool_use", "id": anthropic_id("toolu"), "name": call.name, "input": {}}
        self.content.append(block)
        return events + [("content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": dict(block)})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open, index = None, len(self.content) - 1
        block = self.content[index]
        if block["type"] == "tool_use":
            block["input"] = _tool_input(self.arguments[index])
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    @staticmethod
    def _delta(index: int, delta: dict) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _tool_input(arguments: str) -> dict:
    """A call's input object; arguments cut short by max_tokens are no object yet: {}."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}

