"""`vinoserve serve --speculative-config` over real HTTP: the same replies as the default server (the
shared f32 `api_server`) for greedy, seeded, streamed, n > 1 and schema-constrained requests, and
vLLM's spec_decode counters in /metrics."""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from server_process import ServerProcess
from test_server import metric

pytestmark = pytest.mark.slow
TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n")
EDIT = [{"role": "user", "content": f"Rename the function add to plus in this code and output all of it:\n{TEXT}"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "functions": {
    "type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "functions"], "additionalProperties": False}


@pytest.fixture(scope="module")
def spec_server(smollm2_gguf):
    srv = ServerProcess("--weight-format", "f32", "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--kv-cache-size", "0.5", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 1}').wait_ready()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0)


def _both(api_client, spec_client, **kw):
    return [c.chat.completions.create(model="smollm2-135m-instruct", **kw) for c in (api_client, spec_client)]


def test_replies_equal_the_plain_servers_and_proposals_are_counted(api_client, spec_client, spec_server):
    drafts = metric(spec_server, "vllm:spec_decode_num_draft_tokens_total")
    plain, spec = _both(api_client, spec_client, messages=EDIT, max_tokens=120, temperature=0)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    plain, spec = _both(api_client, spec_client, messages=EDIT, max_tokens=60, temperature=0.8, seed=5, n=2)
    assert [c.message.content for c in spec.choices] == [c.message.content for c in plain.choices]
    proposed = metric(spec_server, "vllm:spec_decode_num_draft_tokens_total") - drafts
    accepted = metric(spec_server, "vllm:spec_decode_num_accepted_tokens_total")
    assert metric(spec_server, "vllm:spec_decode_num_drafts_total") > 0
    assert 0 < accepted <= metric(spec_server, "vllm:spec_decode_num_draft_tokens_total") and proposed > 0
    assert metric(spec_server, "vllm:kv_cache_usage_perc") == 0


def test_streamed_reply_equals_the_plain_one(api_client, spec_client):
    plain = api_client.chat.completions.create(model="smollm2-135m-instruct", messages=EDIT, max_tokens=80, temperature=0)
    chunks = spec_client.chat.completions.create(model="smollm2-135m-instruct", messages=EDIT, max_tokens=80, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == plain.choices[0].message.content
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_schema_constrained_reply_equals_the_plain_one(api_client, spec_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "code", "schema": SCHEMA, "strict": True}}
    ask = [{"role": "user", "content": f"Name this module and list its functions as JSON:\n{TEXT}"}]
    plain, spec = _both(api_client, spec_client, messages=ask, max_tokens=100, temperature=0, response_format=fmt)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    jsonschema.validate(json.loads(spec.choices[0].message.content), SCHEMA)


def test_a_bad_speculative_config_stops_the_server_at_once():
    run = subprocess.run([sys.executable, "-m", "vinoserve.cli", "serve", "--speculative-config",
                          '{"method": "ngram", "num_spec_tokens": 4}'], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "unknown keys ['num_spec_tokens']" in run.stderr
