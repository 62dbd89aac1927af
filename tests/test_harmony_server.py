"""gpt-oss's harmony format through a real server: a tiny random gpt-oss GGUF (gguf_fixtures.py)
whose vocabulary holds the harmony tags as control tokens, with gpt-oss's own chat template
(tests/data, from llama.cpp), <|return|> its eos as in gpt-oss's GGUFs. The server selects the
harmony formats from the template; a random model cannot be steered, so the replies checked are
the forced ones: `tool_choice: required` (and a named function) must give a valid call, and
response_format a valid answer, whatever the model picks inside the grammar. <|end|> is pushed
up by logit_bias, so that any analysis the model opens ends at once."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from gguf_fixtures import BYTE_TOKENS, MERGES, Vocab, tiny_hf_model, write_gguf
from scripted_model import CONTROL
from server_process import ServerProcess
from test_gpt_oss import SPEC
from vinoserve.server.harmony import TAGS

TEMPLATE = (Path(__file__).parent / "data" / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
TOKENS = BYTE_TOKENS + [m.replace(" ", "") for m in MERGES] + list(TAGS) + ["<|endoftext|>"]
VOCAB = Vocab(TOKENS, [1] * (len(TOKENS) - len(TAGS) - 1) + [CONTROL] * (len(TAGS) + 1),
              TOKENS.index("<|return|>"), TEMPLATE)
END = TOKENS.index("<|end|>")
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": CITY}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
F32 = ("--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.05")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony") / "gpt-oss.gguf"
    write_gguf(tiny_hf_model("gpt_oss", vocab=VOCAB, max_positions=4096, **SPEC), path, "gpt_oss", vocab=VOCAB)
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess("--model", str(path), *F32, log_path=log).wait_ready()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    yield client, client.models.list().data[0].id, srv.url
    assert srv.terminate() == 0
    text = log.read_text()
    assert "Traceback" not in text
    assert "tool calls in the harmony format; reasoning parser harmony" in text


def _ask(client: openai.OpenAI, model: str, **kwargs) -> tuple[dict, dict]:
    """The reply whole and streamed: {reasoning, content, calls, finish}."""
    kwargs = {"model": model, "messages": ASK, "temperature": 0, "max_tokens": 60,
              "logit_bias": {str(END): 100}, **kwargs}
    done = client.chat.completions.create(**kwargs).choices[0]
    whole = {"reasoning": getattr(done.message, "reasoning_content", None), "content": done.message.content,
             "calls": [(c.function.name, c.function.arguments) for c in done.message.tool_calls or []],
             "finish": done.finish_reason}
    parts, calls, finish = {"reasoning_content": "", "content": ""}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta.model_dump(exclude_none=True)
        for kind in parts:
            parts[kind] += delta.get(kind) or ""
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    streamed = {"reasoning": parts["reasoning_content"] or None, "content": parts["content"] or None,
                "calls": [tuple(c) for _, c in sorted(calls.items())], "finish": finish}
    return whole, streamed


def test_forced_call_is_a_valid_call(server):
    client, model, _ = server
    whole, streamed = _ask(client, model, tools=TOOLS, tool_choice="required")
    assert whole == streamed
    assert whole["content"] is None and whole["finish"] == "stop" and len(whole["calls"]) == 1
    name, arguments = whole["calls"][0]
    assert name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(arguments), CITY)


def test_named_call_and_the_call_and_its_result_sent_back(server):
    client, model, _ = server
    named = {"type": "function", "function": {"name": "get_time"}}
    whole, _ = _ask(client, model, tools=TOOLS, tool_choice=named)
    assert [c[0] for c in whole["calls"]] == ["get_time"]
    history = ASK + [{"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": whole["calls"][0][1]}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "10:00"}]
    again, _ = _ask(client, model, messages=history, tools=TOOLS, tool_choice=named)
    assert [c[0] for c in again["calls"]] == ["get_time"]


def test_response_format_answer_comes_as_content(server):
    client, model, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    whole, streamed = _ask(client, model, response_format=fmt)
    assert whole == streamed and whole["calls"] == [] and whole["finish"] == "stop"
    jsonschema.validate(json.loads(whole["content"]), CITY)


def test_an_analysis_opened_first_is_split_off(server):
    # "a" (analysis, not final) pushed up enough to win the channel, <|end|> more: an empty analysis.
    client, model, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=80, response_format=fmt,
                                       logit_bias={str(END): 100, str(TOKENS.index("a")): 30})
    m = r.choices[0].message
    jsonschema.validate(json.loads(m.content), CITY)  # no tag nor channel name leaked into it
    assert getattr(m, "reasoning_content", None) is None
    # <|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>, byte by byte
    assert r.usage.completion_tokens >= 28 + len(m.content)


def test_anthropic_thinking_and_tool_turns_render_through_the_template(server):
    # Claude Code's shape: the thinking block goes back as the turn's reasoning, which gpt-oss's
    # template keeps before a call as an analysis message.
    _, model, url = server
    turn = [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"city": "Rome"}}]

    def count(blocks: list[dict]) -> int:
        r = httpx.post(f"{url}/v1/messages/count_tokens", json={
            "model": model, "tools": [{"name": "get_time", "input_schema": CITY}],
            "messages": [{"role": "user", "content": "Time in Rome?"}, {"role": "assistant", "content": blocks},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "10:00"}]}]})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]
    # <|start|> assistant <|channel|> analysis <|message|> Look it up. <|end|>: 1 + 9 + 1 + 8 + 1 + 11 + 1 tokens
    assert count(turn) - count(turn[1:]) == 32
