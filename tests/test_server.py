"""The HTTP server over real loopback: the official openai client, raw httpx for errors, and a
client-disconnect storm; SmolLM2 behind it."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # Answers are asserted by content (Paris, stop strings): f32, so every CPU computes the same
    # greedy text (at bf16 SmolLM2's first answer token depends on the CPU's rounding).
    srv = ServerProcess("--max-num-batched-tokens", "128", "--kv-cache-size", "0.5", "--inference-precision", "f32", "--kv-cache-precision", "f32").wait_ready()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_equals_non_streaming_and_reports_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_length_and_usage(server, client):
    r = client.completions.create(model=MODEL, prompt="The history of Rome", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": "The history of Rome"}).json()["count"]
    assert r.usage.prompt_tokens == count


def test_stop_string_is_cut(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=["Paris"])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and "Paris" not in text and text.startswith("The capital")


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_logprobs_completions_and_streaming_chat(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == len(lp.tokens)
    assert all(len(t) == 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=6,
                                                 logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    # greedy: the chosen token is the most likely one
    assert all(e.logprob >= e.top_logprobs[0].logprob - 1e-4 for e in entries)


def test_tokenize_detokenize_round_trip(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo 你好"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo 你好"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hello " * 9000, "max_tokens": 16}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 9000}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2, 999999]]}, 400, "prompt"),
])
def test_completion_errors(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert "pydantic" not in r.text and "Traceback" not in r.text


def test_chat_and_transport_errors(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_storm_frees_everything(server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        # 64 tokens: the streams that stay outlive the others' disconnects (at their third) by far
        body = {"prompt": f"Story number {i}:", "max_tokens": 64, "temperature": 0.8, "stream": True,
                "ignore_eos": True}
        got = 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if i % 2 and got == 3:
                        return got  # leaving the block closes the connection mid-stream
        return got

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    counts = asyncio.run(storm())
    assert all(c == 3 for c in counts[1::2]) and all(c > 3 for c in counts[0::2])
    assert httpx.get(f"{server.url}/health").status_code == 200
    for _ in range(100):  # aborts land at the next step boundary
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:num_requests_waiting") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:generation_tokens_total") > 0


def test_non_streaming_client_that_leaves_is_aborted(server):
    body = {"prompt": "Go on:", "max_tokens": 2000, "ignore_eos": True}  # about a minute of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_sigterm_lets_the_stream_finish_and_exits_zero(smollm2_gguf):
    srv = ServerProcess("--kv-cache-size", "0.2").wait_ready()
    body = {"prompt": "Count slowly:", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    srv.proc.send_signal(15)
    # every token came (a chunk may carry several: speculation), then the end
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 40
    assert srv.terminate() == 0


def test_api_key_and_queue_limit(smollm2_gguf):
    srv = ServerProcess("--kv-cache-size", "0.2", "--max-queue", "2",
                        env={"VINOSERVE_API_KEY": "s3cret", "VINOSERVE_SERVED_MODEL_NAME": "smol"}).wait_ready()
    try:
        body = {"model": "smol", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        bad = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="smol", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key

        async def burst() -> list[int]:
            long = {"model": "smol", "prompt": "Tell a long story.", "max_tokens": 64, "ignore_eos": True}
            headers = {"Authorization": "Bearer s3cret"}
            async with httpx.AsyncClient(timeout=300) as client:
                rs = await asyncio.gather(*(client.post(f"{srv.url}/v1/completions", json=long, headers=headers)
                                            for _ in range(12)))
            return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert set(codes) == {200, 503} and codes.count(200) >= 2
    finally:
        assert srv.terminate() == 0


def test_cache_eviction_server_and_per_request_overrides(smollm2_gguf):
    srv = ServerProcess("--kv-cache-size", "0.2", "--cache-eviction", "32,32,96",
                        env={"VINOSERVE_EVICTION_AGGREGATION": "sum"}).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=150, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 150
        assert metric(srv, "vinoserve:evicted_blocks_total") > 0
        # inside the context kept keys keep their positions: nothing re-rotated yet
        assert metric(srv, "vinoserve:rotated_blocks_total") == 0
        # a prompt longer than the model's context (8,192), evicted during prefill: positions rebase
        long = client.completions.create(model=MODEL, prompt="one two three four " * 2100, max_tokens=4,
                                         extra_body={"cache_eviction": {"during_prefill": True}})
        assert long.usage.prompt_tokens > 8192 and long.usage.completion_tokens > 0
        assert metric(srv, "vinoserve:rotated_blocks_total") > 0
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model=MODEL, prompt="one two three four " * 2100, max_tokens=4)
        off = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=150, temperature=0,
                                        extra_body={"ignore_eos": True, "cache_eviction": {"enabled": False}})
        assert off.usage.completion_tokens == 150
        bad = httpx.post(f"{srv.url}/v1/completions",
                         json={"prompt": "x", "cache_eviction": {"max_cache_size": 100}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_eviction"
        assert metric(srv, "vllm:kv_cache_usage_perc") == 0
    finally:
        assert srv.terminate() == 0
