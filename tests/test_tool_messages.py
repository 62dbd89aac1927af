"""The generic tool format without a model: tool turns render for templates with and without tool
support, and replies parse into the same calls whether they arrive whole or piece by piece."""
from __future__ import annotations

import json

from vinoserve.model.chat_template import render_chat
from vinoserve.server.event_stream import ParsedText
from vinoserve.server.events import ChoiceResult, Finish, Step
from vinoserve.server.routes.chat import message, step_choices
from vinoserve.server.tools import ToolPlan
from vinoserve.server.tools.generic import GenericFormat

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
    messages, extra = GenericFormat().render(HISTORY, ToolPlan((FN,), False, False), PLAIN)
    text = render_chat(PLAIN, messages, **extra)
    assert extra == {} and "get_weather" in text.split("<|user|>")[0]  # the tools went into the system turn
    assert '<|assistant|>{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in text
    assert '<|user|>{"tool_response": {"tool_call_id": "call_1", "content": "21 C"}}' in text


def test_history_renders_with_native_tool_support():
    messages, extra = GenericFormat().render(HISTORY, ToolPlan((FN,), False, False), NATIVE)
    text = render_chat(NATIVE, messages, **extra)
    assert text.startswith("<tools>get_weather;</tools>")
    assert '<call>get_weather {"city": "Paris"}</call>' in text  # arguments as an object, not a string
    assert "<|tool|>21 C" in text


def _reply(plan: ToolPlan, pieces: list[str], finish_reason: str = "stop") -> tuple[list[list[dict]], dict, str]:
    """Feeds a reply piece by piece, as tokens arrive: the chat deltas after each piece, and the
    message and finish_reason the same events make."""
    text = ParsedText(None, GenericFormat().parser(plan), plan.forced)
    steps = [text.feed(p) for p in pieces]
    more, reason = text.finish(finish_reason)
    steps[-1] += more
    result = ChoiceResult(0)
    for e in [e for step in steps for e in step] + [Finish(reason)]:
        result.add(e)
    return [[_delta(e) for e in step] for step in steps], message(result, False), result.finish_reason


def _delta(e) -> dict:
    """An event as chat's delta (the stream renders them so)."""
    return step_choices(Step(0, (e,)))[0]["delta"]


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[k:k + size] for k in range(0, len(text), size)]


def test_replies_parse_into_calls_or_content():
    plan = ToolPlan((FN,), False, True)
    _, message, reason = _reply(plan, ['{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'])
    assert reason == "tool_calls" and message["content"] is None
    call = message["tool_calls"][0]
    assert call["id"].startswith("call_") and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert _reply(plan, ['{"response": "Hi"}'])[1:] == ({"role": "assistant", "content": "Hi"}, "stop")
    assert _reply(ToolPlan((FN,), True, False), ['{"tool_call": {"name": "get_weather", "arguments": {}}}'])[2] \
        == "stop"
    assert _reply(plan, ['{"tool_ca'], "length")[1:] == ({"role": "assistant", "content": '{"tool_ca'}, "length")


def test_calls_stream_as_they_are_written():
    text = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2], "x": null}}, '
            '{"name": "get_time", "arguments": {}}]}')
    pieces = _pieces(text)
    deltas, message, _ = _reply(ToolPlan((FN, {"name": "get_time"}), False, True), pieces)
    header = text.index('"get_weather"') + len('"get_weather"')
    announced = next(k for k, d in enumerate(deltas) if d)
    assert announced == (header - 1) // 3  # the piece that closed the name, not the end of the reply
    assert deltas[announced][0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    fragments = {0: "", 1: ""}
    for step in deltas:
        for d in step:
            call = d["tool_calls"][0]
            fragments[call["index"]] += call["function"]["arguments"]
    assert sum(1 for step in deltas for d in step if d["tool_calls"][0]["function"].get("arguments")) > 10
    assert [fragments[0], fragments[1]] == [c["function"]["arguments"] for c in message["tool_calls"]]
    assert json.loads(fragments[0]) == {"city": "Oslo", "days": [1, 2], "x": None} and fragments[1] == "{}"


def test_answer_text_streams_decoded_even_when_cut_inside_an_escape():
    text = '{"response": "caf\\u00e9 \\"ok\\"\\n\\ud83d\\ude00!"}'
    for size in (1, 2, 5):
        deltas, message, reason = _reply(ToolPlan((FN,), False, False), _pieces(text, size))
        assert "".join(d["content"] for step in deltas for d in step) == message["content"] == 'café "ok"\n\U0001F600!'
        assert reason == "stop"


def test_a_cut_call_keeps_its_partial_arguments():
    deltas, message, reason = _reply(ToolPlan((FN,), True, False),
                                     _pieces('{"tool_call": {"name": "get_weather", "arguments": {"city": "Os'), "length")
    assert reason == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for step in deltas for d in step) == '{"city": "Os'
