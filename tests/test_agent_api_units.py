"""The Responses and Messages renderers and conversions without a model: the events of one reply
in, the API's objects out (what the HTTP tests cannot reach cheaply: a reply cut by the context
rather than max_tokens, every stop reason, items of one turn put back together, the store's order)."""
from __future__ import annotations

import pytest
from anthropic.types import Message
from openai.types.responses import Response

from vinoserve.server.anthropic.render import MessageBuilder
from vinoserve.server.errors import APIError
from vinoserve.server.events import Finish, ReasoningDelta, Step, TextDelta, ToolCallDelta, ToolCallStart, Usage
from vinoserve.server.responses.items import leading_system, to_messages
from vinoserve.server.responses.render import ResponseBuilder
from vinoserve.server.responses.request import ResponsesRequest
from vinoserve.server.responses.store import ResponseStore, StoredResponse
from vinoserve.server.responses.tools import offered_tools

USAGE = Usage(10, 5, cached_tokens=4)


def _message(events: list, finish: Finish, context_bound: bool = False) -> dict:
    b = MessageBuilder("msg_1", "m", 10, context_bound)
    b.start()
    b.step(Step(0, (*events, finish)))
    b.done(USAGE)
    return Message.model_validate(b.message).model_dump(exclude_none=True)


@pytest.mark.parametrize("events, finish, context_bound, reason, stop", [
    ([TextDelta("hi")], Finish("stop"), False, "end_turn", None),
    ([TextDelta("hi")], Finish("stop", "STOP"), False, "stop_sequence", "STOP"),
    ([TextDelta("hi")], Finish("length"), False, "max_tokens", None),
    ([TextDelta("hi")], Finish("length"), True, "model_context_window_exceeded", None),
    ([ToolCallStart(0, "c1", "f"), ToolCallDelta(0, '{"a": 1}')], Finish("tool_calls"), False, "tool_use", None),
    ([ToolCallStart(0, "c1", "f")], Finish("stop"), False, "tool_use", None),  # a forced call
])
def test_message_stop_reasons(events, finish, context_bound, reason, stop):
    m = _message(events, finish, context_bound)
    assert (m["stop_reason"], m.get("stop_sequence")) == (reason, stop)
    assert m["usage"] == {"input_tokens": 6, "output_tokens": 5, "cache_read_input_tokens": 4,
                          "cache_creation_input_tokens": 0}


def test_message_blocks_in_order_and_a_cut_call_input():
    m = _message([ReasoningDelta("hm"), TextDelta("a"), ToolCallStart(0, "c1", "f"), ToolCallDelta(0, '{"x": 1}'),
                  ToolCallStart(1, "c2", "g"), ToolCallDelta(1, '{"y": ')], Finish("length"))
    ids = [b.get("id") for b in m["content"]]
    assert all(i.startswith("toolu_") for i in ids[2:]) and ids[2] != ids[3]  # Anthropic's, not the format's c1
    assert m["content"] == [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "a"},
                            {"type": "tool_use", "id": ids[2], "name": "f", "input": {"x": 1}},
                            {"type": "tool_use", "id": ids[3], "name": "g", "input": {}}]


def test_response_items_and_events_agree():
    b = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
                         "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}, lambda text: len(text))
    events = b.start() + b.step(Step(0, (ReasoningDelta("r"), TextDelta("t"), ToolCallStart(0, "c1", "f"),
                                         ToolCallDelta(0, "{}"), Finish("length")))) + b.done(USAGE)
    r = Response.model_validate(b.response)
    assert [(o.type, o.status) for o in r.output] == [("reasoning", "completed"), ("message", "completed"),
                                                      ("function_call", "incomplete")]
    assert r.status == "incomplete" and r.usage.output_tokens_details.reasoning_tokens == 1
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == b.response["output"] and events[-1]["response"] == b.response


def test_a_turns_items_become_one_assistant_message():
    items = [{"type": "message", "role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]}]
    assert leading_system([{"role": "system", "content": "rules"}, *to_messages(items)]) == [
        {"role": "system", "content": "rules\n\nbe brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]


def test_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, [], []))
    store.get("a")
    store.put(StoredResponse({"id": "c"}, [], []))
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(Exception, match="No response found"):
        store.get("b")
    ResponseStore(0).put(StoredResponse({"id": "x"}, [], []))  # --max-stored-responses 0 keeps none


# ---- Responses tools: namespaces flattened and split again, built-in tools not offered
FN = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False}
NS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
      "tools": [{"type": "function", "name": "close_agent", "description": "Close one.", "parameters": {}}]}


def _offered(tools: list[dict]):
    return offered_tools(ResponsesRequest.model_validate({"input": "x", "tools": tools}).tools)


def test_namespace_functions_are_offered_flat_and_come_back_apart(caplog):
    offered = _offered([FN, NS, {"type": "web_search", "external_web_access": False}])
    assert [t["function"]["name"] for t in offered.chat] == ["exec_command", "multi_agent_v1__close_agent"]
    assert offered.chat[1]["function"]["description"] == "Sub-agents.\n\nClose one."
    assert offered.split("multi_agent_v1__close_agent") == ("multi_agent_v1", "close_agent")
    assert offered.split("get__weather") == (None, "get__weather")  # only this request's namespaces split
    assert offered.not_offered == ("web_search",) and "web_search" in offered.warning()
    assert "web_search" in caplog.text
    # A call comes back as OpenAI returns it: name and namespace apart.
    b = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "tools": [],
                         "parallel_tool_calls": True, "tool_choice": "auto"}, lambda t: 0, offered.split)
    b.start()
    b.step(Step(0, (ToolCallStart(0, "c1", "multi_agent_v1__close_agent"), ToolCallDelta(0, "{}"),
                    Finish("tool_calls"))))
    b.done(USAGE)
    call = Response.model_validate(b.response).output[0]
    assert (call.name, call.namespace) == ("close_agent", "multi_agent_v1")
    # Sent back, it renders under the name the model was offered.
    item = {"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1",
            "arguments": "{}"}
    assert to_messages([item])[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"


def test_flattened_names_must_be_unique():
    clash = {"type": "function", "name": "multi_agent_v1__close_agent"}
    with pytest.raises(APIError) as e:
        _offered([clash, NS])
    assert e.value.param == "tools" and "multi_agent_v1__close_agent" in e.value.message
