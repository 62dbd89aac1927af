"""POST /v1/messages and /v1/messages/count_tokens over real HTTP with the anthropic SDK, on the
shared SmolLM2 server (f32: greedy replies are exact). Every reply is checked against the SDK's
own types and against the chat completion of the same conversation: the same prompt tokens, the
same text, so a conversion that loses or adds anything shows. (Sampling fields go in extra_body:
this SDK no longer sends temperature.)"""
from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from server_process import leave_stream, sse_events, wait_idle

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": SCHEMA}}]
GREEDY = {"temperature": 0}
EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def claude(api_server):
    return anthropic.Anthropic(base_url=api_server.url, api_key="unused", max_retries=0)


def _chat(api_client, messages: list[dict], **kwargs):
    return api_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def _events(server, body: dict) -> list[dict]:
    """The raw SSE events of a streamed message, each checked against the SDK's event types."""
    events = sse_events(f"{server.url}/v1/messages", body)
    for event in events:
        if event["type"] != "ping":
            EVENTS.validate_python(event)
    return events


def test_create_is_the_chat_reply(api_server, api_client):
    body = {"model": MODEL, "max_tokens": 30, "system": [{"type": "text", "text": "You are a geography teacher."}],
            "messages": ASK, "metadata": {"user_id": "u1"}, **GREEDY}
    raw = httpx.post(f"{api_server.url}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"},
                     timeout=120).json()
    m = Message.model_validate(raw)
    assert re.fullmatch("msg_[0-9a-f]{24}", m.id), m.id  # Anthropic's prefix: clients match on it
    chat = _chat(api_client, [{"role": "system", "content": "You are a geography teacher."}, *ASK], max_tokens=30)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]


def test_stream_reassembles_into_the_whole_reply(api_server, claude):
    body = {"model": MODEL, "max_tokens": 30, "messages": ASK, **GREEDY}
    whole = httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=120).json()
    events = _events(api_server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert events[0]["message"]["id"].startswith("msg_") and events[0]["message"]["id"] != whole["id"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert "".join(e["delta"]["text"] for e in events[3:-3]) == whole["content"][0]["text"]
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    with claude.messages.stream(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole["content"][0]["text"]
    assert final.stop_reason == whole["stop_reason"] and final.usage.output_tokens == whole["usage"]["output_tokens"]


def test_stop_sequence_is_reported(claude, api_client):
    full = _chat(api_client, ASK, max_tokens=30).choices[0].message.content
    word = full.split()[3]  # a word the greedy reply writes
    m = claude.messages.create(model=MODEL, max_tokens=30, messages=ASK, stop_sequences=["zzz", word],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == full[:full.index(word)]
    with claude.messages.stream(model=MODEL, max_tokens=30, messages=ASK, stop_sequences=[word],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_tool_use_stream_and_round_trip(api_server, api_client, claude):
    body = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **GREEDY}
    m = Message.model_validate(httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=120).json())
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and m.stop_reason == "tool_use"
    assert re.fullmatch("toolu_[0-9a-f]{24}", call.id) and m.id.startswith("msg_"), (call.id, m.id)
    jsonschema.validate(call.input, SCHEMA)
    events = _events(api_server, body)
    assert events[2]["content_block"] == {"type": "tool_use", "id": events[2]["content_block"]["id"],
                                          "name": "get_weather", "input": {}}
    assert events[2]["content_block"]["id"].startswith("toolu_")
    streamed = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(streamed) == call.input and events[-2]["delta"]["stop_reason"] == "tool_use"
    # The result goes back in a tool_result block; is_error marks it. The prompt is the chat one.
    messages = [*body["messages"], {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                              "content": [{"type": "text", "text": "service down"}]},
                                             {"type": "text", "text": "Then guess."}]}]
    reply = claude.messages.create(model=MODEL, max_tokens=30, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    chat = _chat(api_client, [
        body["messages"][0],
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Error: service down"},
        {"role": "user", "content": "Then guess."}], tools=CHAT_TOOLS, tool_choice="none", max_tokens=30)
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    count = claude.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER], tool_choice={"type": "none"})
    assert count.input_tokens == chat.usage.prompt_tokens


def test_named_tool_and_count_tokens(api_client, claude):
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Weather?"}],
                               tools=[WEATHER, {**WEATHER, "name": "get_time"}],
                               tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY)
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_time")] and m.stop_reason == "tool_use"
    chat = _chat(api_client, [{"role": "user", "content": "Weather?"}], tools=CHAT_TOOLS, max_tokens=1)
    count = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_claude_code_request_shape(api_server, api_client):
    """What Claude Code sends (captured from its CLI): max_tokens past the context, adaptive thinking,
    effort high, a context edit that keeps all thinking, a system message among the messages,
    stream. On this model the reply is the chat one: none of these changes it."""
    body = {"model": MODEL, "max_tokens": 32000, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u"}, "system": [{"type": "text", "text": "Be brief.",
                                                      "cache_control": {"type": "ephemeral"}}],
            "messages": [*ASK, {"role": "system", "content": "The user is a student."}], **GREEDY}
    events = _events(api_server, body)
    chat = _chat(api_client, [{"role": "system", "content": "Be brief."}, *ASK,
                              {"role": "system", "content": "The user is a student."}])
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == chat.choices[0].message.content and events[-2]["delta"]["stop_reason"] == "end_turn"


@pytest.mark.parametrize("fields, status, kind, says", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error", "messages.0.role"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "system message holds text blocks only"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools.0"),
    ({"tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "invalid_request_error", "does not think"),
    ({"stop_sequences": [str(i) for i in range(17)]}, 400, "invalid_request_error", "stop_sequences"),
    ({"output_config": {"effort": "low"}}, 400, "invalid_request_error", "effort"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
])
def test_errors_in_anthropic_shape(api_server, fields, status, kind, says):
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 5, "messages": ASK, **fields}.items() if v is not None}
    r = httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


def test_sdk_raises_its_own_errors_and_disconnects_free_everything(api_server, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    for content, status, kind in ((b"{nope", 400, "invalid_request_error"),
                                  (b" " * (4 * 2**20 + 1), 413, "request_too_large")):  # over --max-request-bytes
        r = httpx.post(f"{api_server.url}/v1/messages", content=content, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == status and r.json() == {"type": "error", "error": {
            "type": kind, "message": r.json()["error"]["message"]}}
    body = {"model": MODEL, "max_tokens": 2000, "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True}

    assert leave_stream(f"{api_server.url}/v1/messages", body, "content_block_delta") == 3
    assert wait_idle(api_server) == {"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0}
