"""A reasoning model on the Responses and Messages APIs: its reasoning as a `reasoning` item
(reasoning_text content) and as a `thinking` block, streamed and whole; reasoning.effort "none"
and thinking "disabled" turn the chat template's thinking off; earlier reasoning sent back in
the history reaches the template as reasoning_content. The model is test_reasoning.py's scripted
one with Qwen3's real template: it writes `<think>reason</think>` then "Paris" (or, with tools
required, a call in the Hermes format that template selects), so each reply below is exact."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from scripted_model import scripted_gguf
from server_process import ServerProcess
from test_reasoning import ANSWER, F32, SCHEMA, SCRIPT, VOCAB

ASK = "What is the capital of France?"
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
EVENTS = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0}  # this anthropic SDK no longer sends temperature itself


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gguf = scripted_gguf(VOCAB, SCRIPT, tmp_path_factory.mktemp("surfaces") / "scripted.gguf")
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess("--model", str(gguf), *F32, log_path=log).wait_ready()
    yield srv
    assert srv.terminate() == 0
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _respond(server, **fields) -> tuple[Response, list[dict]]:
    """The response whole, and its streamed events (checked against the SDK's types)."""
    body = {"model": "scripted", "input": ASK, "temperature": 0, "max_output_tokens": 20, **fields}
    whole = Response.model_validate(httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).json())
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENTS.validate_python(e)
    return whole, events


def test_responses_reasoning_item(server, oai):
    whole, events = _respond(server)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "reason")]
    assert whole.output_text == "Paris" and whole.usage.output_tokens_details.reasoning_tokens == 1
    kinds = [e["type"] for e in events]
    assert kinds[2:9] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[4]["delta"] == "reason"
    assert Response.model_validate(events[-1]["response"]).output[0].content == reasoning.content
    with oai.responses.stream(model="scripted", input=ASK, temperature=0, max_output_tokens=20) as stream:
        assert stream.get_final_response().output_text == "Paris"


def test_responses_effort_none_turns_thinking_off(server):
    on, _ = _respond(server, reasoning={"effort": "high"})
    off, _ = _respond(server, reasoning={"effort": "none"})
    assert [o.type for o in on.output] == ["reasoning", "message"]
    # The template closed an empty <think></think> in the prompt: all the output is answer.
    assert [o.type for o in off.output] == ["message"] and off.output_text == "<think>reason</think>Paris"
    assert off.usage.input_tokens == on.usage.input_tokens + 6


def test_responses_call_after_reasoning_and_reasoning_sent_back(server, oai):
    whole, _ = _respond(server, tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_output_tokens=80)
    reasoning, call = whole.output
    assert reasoning.content[0].text == "reason" and (call.type, call.arguments) == ("function_call", ANSWER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = oai.responses.create(model="scripted", input=[result], previous_response_id=whole.id, tools=[TOOL],
                                 max_output_tokens=1)
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "reasoning_content": "reason", "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": ANSWER}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    chat = oai.chat.completions.create(model="scripted", messages=history, tools=tools, max_tokens=1)
    forgotten = [history[0], {**history[1], "reasoning_content": ""}, history[2]]
    without = oai.chat.completions.create(model="scripted", messages=forgotten, tools=tools, max_tokens=1)
    assert after.usage.input_tokens == chat.usage.prompt_tokens != without.usage.prompt_tokens


def test_messages_thinking_block(server, claude):
    body = {"model": "scripted", "max_tokens": 20, "messages": [{"role": "user", "content": ASK}],
            "temperature": 0}
    m = Message.model_validate(httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).json())
    assert [b.model_dump(exclude_none=True) for b in m.content] == [
        {"type": "thinking", "thinking": "reason", "signature": ""}, {"type": "text", "text": "Paris"}]
    assert m.stop_reason == "end_turn"
    with claude.messages.stream(model="scripted", max_tokens=2000, messages=body["messages"],
                                thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["thinking_delta", "text_delta"]
    assert [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in m.content]


def test_messages_thinking_disabled_and_sent_back(server, claude, oai):
    off = claude.messages.create(model="scripted", max_tokens=20, messages=[{"role": "user", "content": ASK}],
                                 thinking={"type": "disabled"}, extra_body=GREEDY)
    assert [(b.type, b.text) for b in off.content] == [("text", "<think>reason</think>Paris")]
    tool = {"name": "get_weather", "input_schema": SCHEMA}
    m = claude.messages.create(model="scripted", max_tokens=80, messages=[{"role": "user", "content": ASK}],
                               tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body=GREEDY)
    thinking, call = m.content
    assert thinking.thinking == "reason" and call.input == json.loads(ANSWER) and m.stop_reason == "tool_use"
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    count = claude.messages.count_tokens(model="scripted", messages=history, tools=[tool])
    chat = oai.chat.completions.create(model="scripted", max_tokens=1, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "reasoning_content": "reason", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_openai_agents_loop_runs_the_tool_and_answers(server):
    """openai-agents' default model through a whole loop: the forced call, the tool run by the
    agent, its output (and the call's reasoning item) sent back, then the answer under auto."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="weather", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="scripted", openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=80,
                                                             parallel_tool_calls=False))
    result = agents.Runner.run_sync(agent, ASK, max_turns=3)
    assert calls == ["Paris"] and result.final_output == "Paris"
    first, second = result.raw_responses
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert [o.type for o in second.output] == ["reasoning", "message"]
