"""n choices and prefix caching over HTTP: the official openai client against a real server."""
from __future__ import annotations

import pytest

# The same server settings as test_server.py (a module-scoped server of this module's own).
from test_server import MODEL, client, metric, server  # noqa: F401

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


def test_n_choices_are_reproducible_with_a_seed_and_count_the_prompt_once(server, client):
    before = metric(server, "vllm:prompt_tokens_total")
    kw = dict(model=MODEL, messages=STORY, n=3, seed=11, temperature=1.0, max_tokens=12)
    first = client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert metric(server, "vllm:prompt_tokens_total") - before == first.usage.prompt_tokens
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == texts


def test_streaming_n_choices_equal_the_non_streamed_ones(client):
    kw = dict(model=MODEL, prompt="Once upon a time", n=3, seed=3, temperature=1.0, max_tokens=10)
    full = client.completions.create(**kw)
    texts = ["", "", ""]
    finished = []
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == full.usage.completion_tokens
            assert chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert texts == [c.text for c in full.choices] and sorted(finished) == [0, 1, 2]


def test_follow_up_reports_cached_tokens_and_prefix_metrics(server, client):
    history = [{"role": "user", "content": "Describe the sea in many words. " * 20}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    queries, hits = metric(server, "vllm:prefix_cache_queries_total"), metric(server, "vllm:prefix_cache_hits_total")
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Shorter, please."}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 32 * 32 - 32 <= cached < second.usage.prompt_tokens
    assert metric(server, "vllm:prefix_cache_queries_total") - queries == second.usage.prompt_tokens
    assert metric(server, "vllm:prefix_cache_hits_total") - hits == cached


def test_best_of_returns_the_most_likely_of_the_choices(client):
    kw = dict(model=MODEL, prompt="The weather today is", seed=21, temperature=1.0, max_tokens=8)
    all3 = client.completions.create(n=3, logprobs=0, **kw)
    totals = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = client.completions.create(best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.choices[0].text == all3.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == all3.usage.completion_tokens  # every generated token is billed
    two = client.completions.create(n=2, best_of=3, logprobs=0, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    ranked = sorted(range(3), key=lambda i: -totals[i])
    assert [c.text for c in two.choices] == [all3.choices[i].text for i in ranked[:2]]
