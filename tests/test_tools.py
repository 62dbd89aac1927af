"""Tool calling over real HTTP with the openai client: required, named and auto choices, streamed deltas
that reassemble into the non-streamed calls, and a full agent loop with tool turns in the history."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_gives_calls_and_finish_reason_stop(api_client):
    done = api_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=200, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    _check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1


def test_parallel_calls(api_client):
    # A 135M model can list calls until max_tokens; every reply that ends must hold valid calls.
    ended = []
    for seed in range(3):
        choice = api_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                    max_tokens=80, temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "stop":
            _check_calls(choice.message.tool_calls)
            ended.append(choice)
    assert ended


def test_named_function_is_the_one_called(api_client):
    done = api_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = done.choices[0].message.tool_calls
    _check_calls(calls)
    assert [c.function.name for c in calls] == ["get_time"] and done.choices[0].finish_reason == "stop"


def test_auto_returns_a_call_or_an_answer(api_client):
    for seed in range(4):
        done = api_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                  temperature=1.0, seed=seed, parallel_tool_calls=False)
        choice = done.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason == "stop" and isinstance(choice.message.content, str)


def test_tool_choice_none_is_a_plain_answer(api_client):
    done = api_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=10, temperature=0)
    assert done.choices[0].message.tool_calls is None and done.choices[0].message.content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_deltas_reassemble_into_the_same_calls(api_client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0,
                  parallel_tool_calls=False)
    plain = api_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(api_client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            assert d.id in (None, call["id"])
            call["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in plain.message.tool_calls or []]
    assert [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())] == expected
    assert content == (plain.message.content or "")
    with api_client.chat.completions.stream(**kwargs) as stream:  # the SDK's own reassembly
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls or []] == \
        [(e["name"], e["arguments"]) for e in expected]


class Lookup(BaseModel):
    city: str = Field(max_length=30)


def test_pydantic_function_tool_parses_arguments(api_client):
    done = api_client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Lookup)],
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                             temperature=0)
    call = done.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_agent_loop_call_result_answer(api_client):
    messages = list(ASK)
    first = api_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    assert messages[-1].get("content") is None  # the assistant turn goes back with content null
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    final = api_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=40, temperature=0)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    # The same history renders without tools too, and under auto the loop may go on.
    again = api_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert again.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(api_server, body, param):
    r = httpx.post(f"{api_server.url}/v1/chat/completions", timeout=60, json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
