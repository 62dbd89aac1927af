"""Edges that answered 500 (issue 56), over real HTTP with the openai and anthropic SDKs: a token id
outside the vocabulary, in any field of any API, and a chat template that raises on a request's
values are 400s in the API's own error shape naming the field (and the template, and the
chat_template_kwargs entry); and a running `vinoserve serve` never imports a benchmark module."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from encoder_fixtures import save_embedder
from gguf_fixtures import TOKENS, tiny_hf_model, write_gguf
from server_process import ServerProcess

VOCAB = len(TOKENS)
# A template that raises as real ones do: raise_exception on what it refuses, TypeError and
# ZeroDivisionError on values of a type it did not expect (a kwarg, a message's content).
TEMPLATE = """{%- for m in messages -%}
{%- if m.content == 'RAISE' -%}{{ raise_exception('RAISE is not allowed') }}{%- endif -%}
{%- if m.content == 'TYPE' -%}{{ m.content + 1 }}{%- endif -%}
{{ m.content }}<|im_end|>
{%- endfor -%}
{%- if enable_thinking is defined -%}{{ enable_thinking | length }}{%- endif -%}
{%- if depth is defined -%}{{ 1 // depth }}{%- endif -%}
{%- if add_generation_prompt -%}<think>{%- endif -%}"""
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny chat model with TEMPLATE (and the qwen3 reasoning parser, so that Responses'
    reasoning.effort and Anthropic's thinking reach the template) beside a tiny embedder; imports
    are logged (PYTHONPROFILEIMPORTTIME) for the test that no benchmark module is loaded."""
    root = tmp_path_factory.mktemp("edges")
    hf = tiny_hf_model("llama")
    hf.config.max_position_embeddings = 128
    gguf = write_gguf(hf, root / "tiny.gguf")
    (root / "template.jinja").write_text(TEMPLATE)
    embedder = save_embedder(root / "embedder")
    log = root / "server.log"
    srv = ServerProcess("--model", f"tiny={gguf}", "--model", f"emb={embedder}", "--kv-cache-size", "0.05",
                        "--chat-template", str(root / "template.jinja"), "--reasoning-parser", "qwen3",
                        log_path=log, env={"PYTHONPROFILEIMPORTTIME": "1"}).wait_ready()
    srv.log_path = log
    yield srv
    assert srv.terminate() == 0
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _refused(call, param: str, *words: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.param == param and all(w in e.value.message for w in words), e.value.body
    return e.value.message


# ---- token ids
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ids", [[VOCAB], [5, 10**6]])
def test_stop_token_ids_outside_the_vocabulary_are_400s(client, stream, ids):
    """With min_tokens the sampler held the stop ids back by indexing the logits row: a 500 (an
    error event once streaming); without, they were accepted and could never match."""
    for extra in ({"stop_token_ids": ids, "min_tokens": 1}, {"stop_token_ids": ids}):
        _refused(lambda: client.completions.create(model="tiny", prompt="ab", max_tokens=2, stream=stream,
                                                   extra_body=extra), "stop_token_ids", f"[0, {VOCAB})")
        _refused(lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=stream,
                                                        extra_body=extra), "stop_token_ids", f"[0, {VOCAB})")


def test_stop_token_ids_up_to_the_last_id_stop_after_min_tokens(client):
    some = list(range(VOCAB - 20, VOCAB))  # the last id is in the vocabulary
    reply = client.completions.create(model="tiny", prompt="ab", max_tokens=4, extra_body={
        "stop_token_ids": some, "min_tokens": 1, "ignore_eos": True})
    assert reply.usage.completion_tokens >= 1
    # Every token a stop: whatever is sampled stops, at once without min_tokens; with it nothing
    # could be sampled at all (a 500 before), so it is refused.
    every = list(range(VOCAB))
    reply = client.completions.create(model="tiny", prompt="ab", max_tokens=4, extra_body={"stop_token_ids": every})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    _refused(lambda: client.completions.create(model="tiny", prompt="ab", max_tokens=4, extra_body={
        "stop_token_ids": every, "min_tokens": 2}), "stop_token_ids", "min_tokens")


@pytest.mark.parametrize("bias, words", [
    ({str(VOCAB): 1}, f"[0, {VOCAB})"),
    ({"99999999999999999999999": 1}, f"[0, {VOCAB})"),
    ({"5_0": 1}, "decimal digits"),  # int() reads 50; the schema's pattern refuses it
    ({"+5": 1}, "decimal digits"),
    ({"٣": 1}, "decimal digits"),  # an Arabic-Indic three, which int() reads as 3
])
def test_logit_bias_keys_are_token_ids_in_decimal_digits(client, bias, words):
    _refused(lambda: client.completions.create(model="tiny", prompt="ab", max_tokens=1, logit_bias=bias),
             "logit_bias", words)
    _refused(lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, logit_bias=bias),
             "logit_bias", words)


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": [1, VOCAB]}, "prompt", f"[0, {VOCAB})"),
    ({"prompt": [[1], [2, 10**6]]}, "prompt", f"[0, {VOCAB})"),
    ({"prompt": [1, -1]}, "prompt.1", "greater than or equal to 0"),
    ({"prompt": "ab", "stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    # vLLM's: it would change the output, so it is refused rather than ignored (null or [] change nothing)
    ({"prompt": "ab", "allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ({"prompt": "ab", "bad_words": ["ab"]}, "bad_words", "not supported"),
])
def test_completions_token_id_fields(client, body, param, words):
    prompt = body.pop("prompt")
    _refused(lambda: client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=body),
             param, words)


def test_empty_vllm_lists_change_nothing(client):
    reply = client.completions.create(model="tiny", prompt="ab", max_tokens=1,
                                      extra_body={"allowed_token_ids": [], "bad_words": None})
    assert reply.usage.completion_tokens == 1


@pytest.mark.parametrize("tokens, param", [([VOCAB], "tokens"), ([1, -1], "tokens.1")])
def test_detokenize_token_ids(server, tokens, param):
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("ids, param, words", [
    ([[2, 10**6]], "input", "outside the vocabulary"),
    ([2, -1], "input.1", "greater than or equal to 0"),
    ([[2], [3, -1]], "input.1.1", "greater than or equal to 0"),
])
def test_embeddings_token_ids(client, ids, param, words):
    _refused(lambda: client.embeddings.create(model="emb", input=ids), param, words)


# ---- chat templates that raise
def test_a_template_raising_on_a_kwarg_names_the_template_and_the_kwarg(client):
    for kwargs, name, error in (({"enable_thinking": True}, "enable_thinking", "TypeError"),
                                ({"depth": 0, "other": "x"}, "depth", "ZeroDivisionError"),
                                ({"other": 1, "depth": "a"}, "depth", "TypeError")):
        message = _refused(lambda: client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}),
            f"chat_template_kwargs.{name}", "--chat-template", error)
        assert f"{name}={kwargs[name]!r}" in message


@pytest.mark.parametrize("content, words", [("RAISE", "RAISE is not allowed"), ("TYPE", "TypeError")])
def test_a_template_raising_on_the_messages_names_them(server, client, content, words):
    messages = [{"role": "user", "content": content}]
    _refused(lambda: client.chat.completions.create(model="tiny", messages=messages, max_tokens=1),
             "messages", "--chat-template", words)
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and words in r.text, r.text
    _refused(lambda: client.responses.create(model="tiny", input=content, max_output_tokens=1),
             "input", "--chat-template", words)


def test_responses_name_reasoning_effort(client):
    _refused(lambda: client.responses.create(model="tiny", input="x", max_output_tokens=1,
                                             reasoning={"effort": "low"}),
             "reasoning.effort", "--chat-template", "enable_thinking=True", "TypeError")


def test_anthropic_names_thinking_in_its_own_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=2000, messages=USER,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    error = e.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("thinking: "), error
    assert "enable_thinking=True" in error["message"] and "TypeError" in error["message"]
    for call in (claude.messages.create, claude.messages.count_tokens):
        kwargs = {"max_tokens": 1} if call == claude.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as e:
            call(model="tiny", messages=[{"role": "user", "content": "TYPE"}], **kwargs)
        assert e.value.body["error"]["message"].startswith("messages: "), e.value.body


# ---- what `vinoserve serve` imports
def test_serve_imports_no_benchmark_module(server, client):
    """Every API used once, so each route's lazy imports have run; the log lists every import."""
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    client.completions.create(model="tiny", prompt="ab", max_tokens=1, stream=True).close()
    client.responses.create(model="tiny", input="x", max_output_tokens=1)
    client.embeddings.create(model="emb", input="x")
    httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": USER})
    imported = [line.rsplit("|", 1)[-1].strip() for line in server.log_path.read_text().splitlines()
                if line.startswith("import time:")]
    assert "vinoserve.server.app" in imported and "vinoserve.server.routes.responses" in imported
    assert not [m for m in imported if m.startswith("vinoserve.bench")]
