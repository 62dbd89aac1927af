"""POST /v1/responses over real HTTP with the openai SDK (create, stream, parse) and openai-agents'
default Responses model, on the shared SmolLM2 server (f32: greedy replies are exact). Every
reply is checked against the SDK's own types, and against the chat completion of the same
conversation: the same prompt tokens and the same text, so a conversion that loses or adds
anything shows."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from server_process import leave_stream, sse_events, wait_idle

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def _events(server, body: dict) -> list[dict]:
    """The raw SSE events of a streamed response, each checked against the SDK's event types."""
    events = sse_events(f"{server.url}/v1/responses", body)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


_VARYING = ("id", "call_id", "created_at", "completed_at", "cached_tokens")


def _same(a: dict, b: dict) -> bool:
    """Two Response objects alike but for ids, times and prefix-cache hits."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _VARYING}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(a) == strip(b)


def test_create_is_the_chat_reply(api_server, api_client):
    raw = httpx.post(f"{api_server.url}/v1/responses", timeout=120, json={
        "model": MODEL, "input": ASK, "instructions": "Answer briefly.", "max_output_tokens": 24, "temperature": 0,
        "metadata": {"k": "v"}}).json()
    r = Response.model_validate(raw)
    chat = _chat(api_client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}],
                 max_tokens=24)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    status = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert r.status == r.output[0].status == status and [o.type for o in r.output] == ["message"]
    assert r.metadata == {"k": "v"} and r.instructions == "Answer briefly."


def test_stream_reassembles_into_the_whole_reply(api_server, api_client):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    whole = httpx.post(f"{api_server.url}/v1/responses", json=body, timeout=120).json()
    events = _events(api_server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] == events[-4]["text"]
    assert _same(events[-1]["response"], whole)
    with api_client.responses.stream(**body) as stream:
        assert stream.get_final_response().output_text == text


def test_max_output_tokens_makes_it_incomplete(api_server, api_client):
    r = api_client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=16)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 16 and r.output[0].status == "incomplete"
    events = _events(api_server, {"input": "Tell me a long story.", "max_output_tokens": 16})
    assert events[-1]["type"] == "response.incomplete"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_parse_holds_the_reply_to_the_schema(api_client):
    r = api_client.responses.parse(model=MODEL, input="Name a big city and its country.", text_format=City,
                                   temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City)
    # json_object is chat's json_object: the same constrained text (here cut at 40 tokens).
    r = api_client.responses.create(model=MODEL, input="Describe Paris in JSON.", temperature=0, max_output_tokens=40,
                                    text={"format": {"type": "json_object"}})
    chat = _chat(api_client, [{"role": "user", "content": "Describe Paris in JSON."}], max_tokens=40,
                 response_format={"type": "json_object"})
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("{")


def test_tool_call_stream_and_round_trip(api_server, api_client):
    body = {"model": MODEL, "input": "What is the weather like in Paris?", "tools": [WEATHER], "temperature": 0,
            "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60}
    raw = httpx.post(f"{api_server.url}/v1/responses", json=body, timeout=120).json()
    r = Response.model_validate(raw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = _events(api_server, body)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert deltas == done[0]["arguments"] == call.arguments and done[0]["name"] == "get_weather"
    assert _same(events[-1]["response"], raw)
    # The tool's output goes back as a function_call_output item, after the stored call.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    after = api_client.responses.create(model=MODEL, input=[result], previous_response_id=r.id, tools=[WEATHER],
                                        temperature=0, max_output_tokens=20, tool_choice="none")
    chat = _chat(api_client, [
        {"role": "user", "content": body["input"]},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice="none", max_tokens=20)
    assert after.usage.input_tokens == chat.usage.prompt_tokens
    assert after.output_text == chat.choices[0].message.content


def test_previous_response_id_get_delete_and_input_items(api_server, api_client):
    first = api_client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=20)
    second = api_client.responses.create(model=MODEL, input=[{"role": "user", "content": "And of Germany?"}],
                                         previous_response_id=first.id, temperature=0, max_output_tokens=20)
    chat = _chat(api_client, [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And of Germany?"}], max_tokens=20)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert api_client.responses.retrieve(first.id).output_text == first.output_text
    again = httpx.get(f"{api_server.url}/v1/responses/{first.id}", params={"stream": "true"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    items = ResponseItemList.model_validate(
        httpx.get(f"{api_server.url}/v1/responses/{second.id}/input_items", params={"order": "asc"}).json())
    assert [i.content[0].text for i in items.data] == ["And of Germany?"] and not items.has_more
    api_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:  # the history is gone with it
        api_client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    kept_nothing = api_client.responses.create(model=MODEL, input=ASK, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        api_client.responses.retrieve(kept_nothing.id)


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "custom", "name": "patch"}]}, "tools.0"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),  # built-in: never offered
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.message.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.function_call.call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.message.role"),
    ({"input": 5}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include.0"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.json_schema.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(api_server, fields, param):
    r = httpx.post(f"{api_server.url}/v1/responses", json={"model": MODEL, "input": ASK, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_model_and_disconnect_leave_nothing_behind(api_server, api_client):
    with pytest.raises(openai.NotFoundError):
        api_client.responses.create(model="nope", input=ASK)
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 2000, "stream": True}

    assert leave_stream(f"{api_server.url}/v1/responses", body, "response.output_text.delta") == 3
    assert wait_idle(api_server) == {"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0}


def test_openai_agents_default_model_runs_a_function_tool(api_server):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                             parallel_tool_calls=False, max_tokens=60),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather like in Paris?", max_turns=3)
    assert len(calls) == 1 and result.final_output == f"It is sunny in {calls[0]}."
    [response] = result.raw_responses
    assert response.output[0].type == "function_call"
