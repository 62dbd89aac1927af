"""Tool turns render for templates with and without tool support (no model needed)."""
from __future__ import annotations

import json

from vinoserve.model.chat_template import render_chat
from vinoserve.server.tools import ToolPlan, parse_reply, render_messages, stream_deltas

PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
# The shape of Qwen2.5's template: tools in the system turn, calls as tojson'd objects, tool results.
NATIVE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
          "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
          "{% endfor %}\n{% endfor %}")
FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_history_renders_without_tool_support():
    messages, extra = render_messages(HISTORY, ToolPlan((FN,), False, False), PLAIN)
    text = render_chat(PLAIN, messages, **extra)
    assert extra == {} and "get_weather" in text.split("<|user|>")[0]  # the tools went into the system turn
    assert '<|assistant|>{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in text
    assert '<|user|>{"tool_response": {"tool_call_id": "call_1", "content": "21 C"}}' in text


def test_history_renders_with_native_tool_support():
    messages, extra = render_messages(HISTORY, ToolPlan((FN,), False, False), NATIVE)
    text = render_chat(NATIVE, messages, **extra)
    assert text.startswith("<tools>get_weather;</tools>")
    assert '<call>get_weather {"city": "Paris"}</call>' in text  # arguments as an object, not a string
    assert "<|tool|>21 C" in text


def test_replies_parse_into_calls_or_content():
    plan = ToolPlan((FN,), False, True)
    message, reason = parse_reply(plan, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}',
                                  "stop")
    assert reason == "tool_calls" and message["content"] is None
    call = message["tool_calls"][0]
    assert call["id"].startswith("call_") and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    deltas = stream_deltas(message)
    assert deltas[0]["tool_calls"][0]["id"] == call["id"]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert parse_reply(plan, '{"response": "Hi"}', "stop") == ({"role": "assistant", "content": "Hi"}, "stop")
    assert parse_reply(ToolPlan((FN,), True, False), '{"tool_call": {"name": "get_weather", "arguments": {}}}',
                       "stop")[1] == "stop"
    assert parse_reply(plan, '{"tool_ca', "length") == ({"role": "assistant", "content": '{"tool_ca'}, "length")
