"""Tool parameter schemas compile leniently: keywords llguidance cannot enforce (Claude Code's tools
use propertyNames) leave the constraint, with one warning in the log, instead of a 400 that makes
the client unusable; the rest of the schema still holds. A tool marked strict, and response_format,
keep the whole schema or are refused. Over real HTTP on the shared SmolLM2 server."""
from __future__ import annotations

import copy
import json
import logging

import httpx
import jsonschema
import pytest

from vinoserve.scheduler.grammar import GrammarSpec

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
# Shaped as Claude Code's tools are (zod's JSON schemas): $schema, descriptions, bounds, a record
# with propertyNames, an array with uniqueItems, additionalProperties false.
BASH = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute", "maxLength": 40},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)",
                    "exclusiveMinimum": 0, "maximum": 600000},
        "env": {"type": "object", "description": "Extra environment variables",
                "propertyNames": {"type": "string", "pattern": "^[A-Z_][A-Z0-9_]*$"},
                "additionalProperties": {"type": "string", "maxLength": 20}, "maxProperties": 2},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["build", "test"]}, "uniqueItems": True},
    },
    "required": ["command", "env"], "additionalProperties": False,
}
UNENFORCED = ("propertyNames", "uniqueItems")
ASK = [{"role": "user", "content": "List the files in /tmp"}]


def _enforced(schema):
    """`schema` without the keywords llguidance leaves out: what the reply must still satisfy."""
    if isinstance(schema, list):
        return [_enforced(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: _enforced(v) for k, v in schema.items() if k not in UNENFORCED}


def _chat(server, tools: list[dict], **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, "tools": tools, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_a_claude_code_like_tool_schema_through_messages(api_server):
    body = {"model": MODEL, "max_tokens": 80, "messages": ASK, "temperature": 0,
            "tools": [{"name": "Bash", "description": "Executes a bash command", "input_schema": BASH}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    r = httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    [call] = r.json()["content"]
    assert call["type"] == "tool_use" and call["name"] == "Bash"
    jsonschema.validate(call["input"], _enforced(BASH))  # bounds, enums, required, no extras: all held


def test_the_same_schema_through_chat_completions_and_responses_format(api_server):
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
    r = _chat(api_server, tools, tool_choice="required", parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), _enforced(BASH))
    # As an answer's format the schema is the product, not a tool's input: strict, a 400 naming the keyword.
    r = httpx.post(f"{api_server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bash", "schema": BASH}}})
    assert r.status_code == 400 and "propertyNames" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "response_format"


def test_a_strict_tool_is_held_to_its_whole_schema_or_refused(api_server):
    r = _chat(api_server, [{"type": "function", "function": {"name": "Bash", "parameters": BASH, "strict": True}}])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools", r.text
    assert error["message"].startswith("invalid tools (Bash is strict): ") and "propertyNames" in error["message"]
    r = httpx.post(f"{api_server.url}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 5, "messages": ASK,
        "tools": [{"name": "Bash", "input_schema": BASH, "strict": True}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "propertyNames" in r.json()["error"]["message"]
    supported = copy.deepcopy(BASH)
    for prop in supported["properties"].values():
        for keyword in UNENFORCED:
            prop.pop(keyword, None)
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": supported, "strict": True}}]
    r = _chat(api_server, tools, tool_choice="required", parallel_tool_calls=False)
    assert r.status_code == 200, r.text


def test_what_is_left_out_is_logged_once_per_schema(api_server, caplog):
    from vinoserve.scheduler.grammar import GrammarCompiler

    compiler = GrammarCompiler([bytes([i]) for i in range(256)], 257, [256], [], lambda s: list(s.encode()))
    spec = GrammarSpec.json_schema({**BASH, "x-guidance": {"lenient": True}})
    with caplog.at_level(logging.WARNING, logger="vinoserve.scheduler.grammar"):
        compiler.compile(spec)
        compiler.compile(spec)  # cached: no second warning
    assert [r.getMessage() for r in caplog.records] == [
        "grammar compiled without what llguidance cannot enforce: " + w
        for w in ['Unimplemented keys: ["propertyNames"]', 'Unimplemented keys: ["uniqueItems"]']], caplog.text
    with pytest.raises(ValueError, match="propertyNames"):
        compiler.compile(GrammarSpec.json_schema(BASH))
