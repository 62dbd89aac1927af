"""The same request gives the same answer: one `vinoserve serve` at its default flags (this CPU
class's precisions, prompt lookup speculation, prefix caching), the built-in model, one request
at a time. Each probe is sent 20 times and must come back the same every time, greedy and
seeded; a prompt served from the prefix cache must give the logprobs of one computed whole."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_process import ServerProcess
from test_server import metric

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
REPEATS = 20
TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n")
GREEK = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
COPY = [{"role": "user", "content": f"Rename the function add to plus in this code and output all of it:\n{TEXT}"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CHAT_PROBES = {
    "forced tools": {"messages": [{"role": "user", "content": "What's the weather like in Paris and in Rome?"}],
                     "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 64},
    "copying": {"messages": COPY, "temperature": 0, "max_tokens": 64},
    "seeded": {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
               "temperature": 0.8, "seed": 7, "max_tokens": 48},
    "seeded, n=2, copying": {"messages": COPY, "temperature": 0.8, "seed": 3, "n": 2, "max_tokens": 40},
}


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    srv = ServerProcess().wait_ready()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat_reply(client: openai.OpenAI, body: dict) -> str:
    r = client.chat.completions.create(model=MODEL, **body)
    return json.dumps([[c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
                        c.finish_reason] for c in r.choices] + [r.usage.completion_tokens])


@pytest.mark.parametrize("name", CHAT_PROBES)
def test_a_chat_request_repeats(client, server, name):
    drafts = metric(server, "vllm:spec_decode_num_drafts_total")
    replies = {_chat_reply(client, CHAT_PROBES[name]) for _ in range(REPEATS)}
    assert len(replies) == 1, "\n".join(sorted(replies))
    if name == "copying":  # speculation verified proposals in these replies: what can move them
        assert metric(server, "vllm:spec_decode_num_drafts_total") > drafts


def test_a_long_free_completion_repeats(client):
    def reply() -> str:
        r = client.completions.create(model=MODEL, prompt="The history of the city of Lyon begins", temperature=0,
                                      max_tokens=128)
        return json.dumps([r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens])

    replies = {reply() for _ in range(REPEATS)}
    assert len(replies) == 1, "\n".join(sorted(replies))


@pytest.mark.parametrize("length", [33, 34, 36, 42, 48, 161, 257, 300])
def test_a_prompt_from_the_prefix_cache_gives_the_logits_of_one_computed_whole(client, server, length):
    """The first request computes the prompt (in chunks of the step budget, 256 tokens); the
    second finds its full blocks cached and computes only the rest, 1 to 31 tokens by the length."""
    words = " ".join(f"{w}{length}" for w in GREEK * 60)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": words}).json()["tokens"][:length]
    assert len(ids) == length

    def reply() -> tuple:
        r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6, logprobs=5)
        return r.choices[0].text, r.choices[0].logprobs.top_logprobs, r.usage.prompt_tokens_details

    computed, hit = reply(), reply()
    assert computed[2] is None or not computed[2].cached_tokens
    assert length < 64 or hit[2].cached_tokens > 0
    assert hit[:2] == computed[:2]
