"""The event stream of one response as the Responses API's objects: the streamed events
(response.created ... response.completed, each with its sequence_number) and the Response they
add up to. A whole reply is the same builder with its events dropped, so a stream always
reassembles into exactly the reply it would have been.

Each kind of event opens its own output item: reasoning (a `reasoning` item whose content is
reasoning_text), answer text (a `message` with one output_text part), each tool call (a
`function_call`). An item is done when the next one opens or the response ends."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable

from vinoserve.server.errors import failure
from vinoserve.server.events import Finish, ReasoningDelta, Step, TextDelta, ToolCallDelta, ToolCallStart, Usage
from vinoserve.server.responses.items import item_id


class ResponseBuilder:
    def __init__(self, response: dict, count_tokens: Callable[[str], int],
                 split_name: Callable[[str], tuple[str | None, str]] = lambda name: (None, name)) -> None:
        """`response`: the Response's fields that echo the request (id, model, tools, ...);
        `split_name`: a called name as (namespace, name) (responses/tools.py)."""
        self.response = {**response, "status": "in_progress", "output": [], "error": None,
                         "incomplete_details": None, "usage": None}
        self.count_tokens = count_tokens
        self.split_name = split_name
        self.sequence = 0
        self.open: tuple | None = None  # the open item's key: ("reasoning",), ("message",) or ("call", k)
        self.calls: dict[int, int] = {}  # a call's index -> its output index
        self.finish = Finish(None)

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def step(self, step: Step) -> list[dict]:
        events: list[dict] = []
        for e in step.events:
            if isinstance(e, ReasoningDelta) and e.text:
                events += self._switch(("reasoning",))
                item = self.output[-1]
                item["content"][0]["text"] += e.text
                events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                                          delta=e.text))
            elif isinstance(e, TextDelta) and e.text:
                events += self._switch(("message",))
                self.output[-1]["content"][0]["text"] += e.text
                events.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                          delta=e.text, logprobs=[]))
            elif isinstance(e, ToolCallStart):
                events += self._switch(("call", e.call_index), e)
            elif isinstance(e, ToolCallDelta):
                index = self.calls[e.call_index]
                self.output[index]["arguments"] += e.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                          output_index=index, delta=e.arguments))
            elif isinstance(e, Finish):
                self.finish = e
        return events

    def done(self, usage: Usage) -> list[dict]:
        """The response has ended: its last item closes, then response.completed (or
        response.incomplete when max_output_tokens cut it)."""
        events = [] if self.output else self._switch(("message",))  # an empty answer is an empty message
        events += self._close()
        reasoning = sum(self.count_tokens(i["content"][0]["text"]) for i in self.output if i["type"] == "reasoning")
        cut = self.finish.reason == "length"
        self.response.update(
            status="incomplete" if cut else "completed", completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                   "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                   "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                   "output_tokens_details": {"reasoning_tokens": min(reasoning, usage.completion_tokens)}})
        return events + [self._event(f"response.{self.response['status']}", response=self._snapshot())]

    def failed(self, error: Exception) -> list[dict]:
        """A failure after the stream began: response.failed, with the error as OpenAI words it."""
        status, message, _ = failure(error)
        self.response.update(status="failed", error={"code": "server_error" if status >= 500 else "invalid_prompt",
                                                     "message": message})
        return [self._event("response.failed", response=self._snapshot())]

    def _switch(self, key: tuple, call: ToolCallStart | None = None) -> list[dict]:
        """Makes `key` the open item, closing the one before."""
        if self.open == key:
            return []
        events = self._close()
        self.open, index = key, len(self.output)
        if key[0] == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif key[0] == "message":
            item = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self.calls[call.call_index] = index
            namespace, name = self.split_name(call.name)
            item = {"id": item_id("fc"), "type": "function_call", "call_id": call.id, "name": name,
                    **({"namespace": namespace} if namespace else {}), "arguments": "", "status": "in_progress"}
            part = None
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item)))
        if part is not None:
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=dict(part)))
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        item, where = self.output[-1], self._where()
        self.open = None
        item["status"] = "incomplete" if self.finish.reason == "length" else "completed"
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if kind == "reasoning_text" else {"logprobs": []}
            events = [self._event(f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        return events + [self._event("response.output_item.done", output_index=where["output_index"],
                                     item=copy.deepcopy(item))]

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict:
        return copy.deepcopy(self.response)

