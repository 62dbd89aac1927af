"""Reasoning models over real HTTP with the openai client: `<think>...</think>` goes to
reasoning_content (and `reasoning`), streamed and not, with the real Qwen3 and DeepSeek-R1 chat
templates (tests/data, from llama.cpp's models/templates); response_format and tools constrain
only what follows the reasoning. The model is a tiny scripted one (scripted_model.py) that writes
`<think>reason</think>` and then "Paris", or, where a grammar or logit_bias forbids that, its
next choices: so each reply below is exact, and differs if the server gets a step wrong."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from scripted_model import scripted_gguf, scripted_vocab
from server_process import ServerProcess
from vinoserve.model.chat_template import render_chat
from vinoserve.server.events import ReasoningDelta, TextDelta
from vinoserve.server.reasoning import FORMATS, Start, select_reasoning

DATA = Path(__file__).parent / "data"
QWEN3 = (DATA / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
DEEPSEEK_R1 = DATA / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
ANSWER = '{"city": "Paris"}'
CALL = "<tool_call>\n"  # Qwen3's template is Hermes': a call opens so, then its JSON is forced byte by byte
ADDED = ["<think>", "</think>", "reason", "Paris", '"}', ANSWER, CALL]
VOCAB = scripted_vocab(ADDED, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", QWEN3)
THINK = VOCAB.tokens.index("<think>")
SCRIPT = {
    "Ċ": ["<think>", "Paris", ANSWER],  # every template here ends its prompt with "\n"
    "<think>": ["reason"], "reason": ["</think>"],
    "</think>": ["Paris", ANSWER, CALL],
    "Paris": ["<|im_end|>", '"}'], ANSWER: ["<|im_end|>"],
    # A schema's forced opening `{"city": "` comes byte by byte; then "Paris", and `"}` to close.
    '"': ["Paris"], '"}': ["<|im_end|>"],
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
F32 = ("--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.05")


@pytest.mark.parametrize("state, text, reasoning, answer", [
    (Start.OPEN, "Let me think.</think>\n\nParis", "Let me think.", "Paris"),
    (Start.OPEN, "<think>\nhm</think>Paris", "\nhm", "Paris"),  # a start tag the prompt already wrote
    (Start.OPEN, "a</thinkb</think>c", "a</thinkb", "c"),
    (Start.OPEN, "cut short", "cut short", ""),
    (Start.UNOPENED, "  <think>x</think> y", "x", "y"),
    (Start.UNOPENED, "Paris <think>", "", "Paris <think>"),
    (Start.UNOPENED, "<thi", "", "<thi"),
    (Start.CLOSED, "<think>x</think>y", "", "<think>x</think>y"),
])
def test_reasoning_splits_the_same_in_any_pieces(state, text, reasoning, answer):
    for size in range(1, len(text) + 1):
        parser = FORMATS["qwen3"].parser(state)
        events = [e for k in range(0, len(text), size) for e in parser.feed(text[k:k + size])] + parser.finish()
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == reasoning
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == answer
        assert all(e.text for e in events)


def test_the_family_and_where_the_prompt_leaves_it_come_from_the_template():
    deepseek = DEEPSEEK_R1.read_text(encoding="utf-8")
    assert select_reasoning("auto", QWEN3).name == "qwen3"
    assert select_reasoning("auto", deepseek).name == "deepseek_r1"
    assert select_reasoning("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert select_reasoning("none", QWEN3) is None and select_reasoning("qwen3", "").name == "qwen3"
    fmt = FORMATS["qwen3"]
    assert fmt.start_state(render_chat(QWEN3, ASK)) is Start.UNOPENED
    assert fmt.start_state(render_chat(QWEN3, ASK, enable_thinking=False)) is Start.CLOSED
    assert FORMATS["deepseek_r1"].start_state(render_chat(deepseek, ASK, bos_token="")) is Start.OPEN


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return scripted_gguf(VOCAB, SCRIPT, tmp_path_factory.mktemp("reasoning") / "scripted.gguf")


def _serve(gguf: Path, tmp_path_factory, *args: str):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess("--model", str(gguf), *F32, *args, log_path=log).wait_ready()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    yield srv, client
    assert srv.terminate() == 0
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def qwen3(gguf, tmp_path_factory):
    """The model's own template, Qwen3's: --reasoning-parser auto finds qwen3."""
    yield from _serve(gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek(gguf, tmp_path_factory):
    """DeepSeek-R1's template instead (--chat-template): it opens <think> in the prompt."""
    yield from _serve(gguf, tmp_path_factory, "--chat-template", str(DEEPSEEK_R1))


def _ask(client: openai.OpenAI, **kwargs) -> tuple[dict, dict]:
    """The reply whole and streamed, each as {reasoning, content, tool_calls, finish_reason}."""
    kwargs = {"model": "scripted", "messages": ASK, "temperature": 0, "max_tokens": 20, **kwargs}
    done = client.chat.completions.create(**kwargs).choices[0]
    m = done.message
    reasoning = getattr(m, "reasoning_content", None)
    assert getattr(m, "reasoning", None) == reasoning  # vLLM's newer name and its older one
    whole = {"reasoning": reasoning, "content": m.content, "finish_reason": done.finish_reason,
             "tool_calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []]}
    kinds, parts, calls = [], {"reasoning": "", "content": ""}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        for kind in ("reasoning", "content"):
            if delta.get(kind):
                parts[kind] += delta[kind]
                kinds.append(kind)
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, [d.function.name, ""])
            call[1] += d.function.arguments or ""
        streamed_finish = choice.finish_reason or None
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all reasoning comes first
    streamed = {"reasoning": parts["reasoning"] or None, "content": parts["content"] or None,
                "finish_reason": streamed_finish, "tool_calls": [tuple(c) for _, c in sorted(calls.items())]}
    return whole, streamed


def test_qwen3_reasoning_goes_to_reasoning_content(qwen3):
    whole, streamed = _ask(qwen3[1])
    assert whole == streamed == {"reasoning": "reason", "content": "Paris", "finish_reason": "stop", "tool_calls": []}


def test_qwen3_thinking_off_is_all_answer(qwen3):
    srv, client = qwen3
    on = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0,
                                        logit_bias={str(THINK): -100})
    whole, streamed = _ask(client, logit_bias={str(THINK): -100}, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    assert whole == streamed == {"reasoning": None, "content": "Paris", "finish_reason": "stop", "tool_calls": []}
    off = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The template closed an empty <think>\n\n</think>\n\n in the prompt: 6 more tokens.
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 6


def test_qwen3_response_format_holds_only_the_answer(qwen3):
    whole, streamed = _ask(qwen3[1], response_format=FORMAT)
    assert whole == streamed == {"reasoning": "reason", "content": ANSWER, "finish_reason": "stop", "tool_calls": []}
    jsonschema.validate(json.loads(whole["content"]), SCHEMA)
    # Thinking off, the prompt has closed the reasoning: the schema holds from the first token.
    whole, streamed = _ask(qwen3[1], response_format=FORMAT,
                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert whole == streamed == {"reasoning": None, "content": ANSWER, "finish_reason": "stop", "tool_calls": []}


def test_qwen3_tool_call_after_reasoning(qwen3):
    whole, streamed = _ask(qwen3[1], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                           max_tokens=80)
    assert whole == streamed == {"reasoning": "reason", "content": None, "finish_reason": "stop",
                                 "tool_calls": [("get_weather", ANSWER)]}


def test_deepseek_r1_reasoning_opened_by_the_template(deepseek):
    srv, client = deepseek
    whole, streamed = _ask(client)
    assert whole == streamed == {"reasoning": "reason", "content": "Paris", "finish_reason": "stop", "tool_calls": []}
    # The prompt opened <think>: a reply that never closes it is all reasoning.
    whole, streamed = _ask(client, logit_bias={str(THINK): -100})
    assert whole == streamed == {"reasoning": "Paris", "content": None, "finish_reason": "stop", "tool_calls": []}
    whole, streamed = _ask(client, response_format=FORMAT)
    assert whole == streamed == {"reasoning": "reason", "content": ANSWER, "finish_reason": "stop", "tool_calls": []}


def test_reasoning_parser_none_leaves_the_text_alone(gguf, tmp_path_factory):
    for srv, client in _serve(gguf, tmp_path_factory, "--reasoning-parser", "none"):
        whole, _ = _ask(client)
        assert whole["content"] == "<think>reason</think>Paris" and whole["reasoning"] is None
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 5}).json()
        assert "reasoning_content" not in r["choices"][0]["message"]
