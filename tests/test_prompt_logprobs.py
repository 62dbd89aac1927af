"""Prompt scoring and logit_bias over real HTTP: echo's prompt logprobs equal HF transformers' f32
log-softmax of the same prompt, vLLM's prompt_logprobs on both endpoints, and logit_bias moves greedy picks."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SHORT = "The quick brown fox jumps over the lazy dog, and then"
# Past the scheduler's 256-token chunk budget, so the prompt is scored over several chunks.
LONG = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """log P(ids[p] | ids[:p]) for p >= 1, at f32 as the server computes its logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def tokens(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_echo_scores_the_prompt_like_hf(api_server, smollm2_hf, prompt):
    ids = tokens(api_server, prompt)
    body = post(api_server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], hf_logprobs(smollm2_hf, ids), atol=1e-4, rtol=0)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])


def test_echo_with_generation_streams_the_same(api_server):
    body = {"prompt": SHORT, "max_tokens": 4, "echo": True, "logprobs": 0, "temperature": 0}
    plain = post(api_server, "/v1/completions", body).json()["choices"][0]
    assert plain["text"].startswith(SHORT) and len(plain["text"]) > len(SHORT)
    assert len(plain["logprobs"]["tokens"]) == len(tokens(api_server, SHORT)) + 4
    events = post(api_server, "/v1/completions", {**body, "stream": True}).text.split("\n\n")
    import json

    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    streamed = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], plain["logprobs"]["token_logprobs"][1:], atol=1e-6)


def test_vllm_prompt_logprobs_both_endpoints(api_server, smollm2_hf):
    ids = tokens(api_server, SHORT)
    comp = post(api_server, "/v1/completions", {"prompt": SHORT, "max_tokens": 1, "prompt_logprobs": 1}).json()
    plp = comp["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = hf_logprobs(smollm2_hf, ids)
    for p, entry in enumerate(plp[1:], 1):
        own = entry[str(ids[p])]
        assert abs(own["logprob"] - ref[p - 1]) < 1e-4 and own["rank"] >= 1
        assert any(e["rank"] == 1 for e in entry.values())
    messages = [{"role": "user", "content": "Hello there"}]
    chat_ids = post(api_server, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = post(api_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    got = [e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"][1:], chat_ids[1:])]
    np.testing.assert_allclose(got, hf_logprobs(smollm2_hf, chat_ids), atol=1e-4, rtol=0)


def test_logit_bias_moves_the_greedy_token(api_server):
    def first(bias: dict | None = None, n: int = 1) -> list[int]:
        body = {"prompt": SHORT, "max_tokens": n, "temperature": 0, "logprobs": 0, "logit_bias": bias or {}}
        out = post(api_server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
        return [tokens(api_server, t)[0] if t else None for t in out]

    greedy = first()[0]
    assert first({str(greedy): -100})[0] != greedy
    forced = tokens(api_server, " banana")[0]
    assert first({str(forced): 100}, n=3) == [forced] * 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_scoring_requests_are_400(api_server, body, param):
    r = post(api_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
