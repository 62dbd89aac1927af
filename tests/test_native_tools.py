"""Native tool-call formats end to end: real HTTP, the openai client, the real chat templates of each
family (tests/data), llguidance's grammars on the real engine path. Each model is a tiny scripted
one (scripted_model.py) that writes its family's format in a few whole tokens, ranked so that the
grammar decides: under `required` its favourite opening (text) is refused and the call is taken;
under `auto` the text comes first and the opening after it, and right after the opening its
favourite ("Paris") is refused in favour of a call that fits the tools' schemas. So each reply
below is exact, and changes if the trigger, the constraint or the parser goes wrong.

Where the grammar forces text (`{"name": "get_` once a call has opened), llguidance allows only
the tokenizer's own tokenization of it, which is why those pieces are tokens of their own; where
it leaves a choice, any token that fits is allowed ('weather", "arguments": ...').

Hermes runs on a model whose own template knows no tools, given vLLM's Hermes template with
--chat-template (auto detects the format from it); Llama 3.2 and Mistral Nemo use their own."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from scripted_model import scripted_gguf, scripted_vocab
from server_process import ServerProcess

DATA = Path(__file__).parent / "data"
CITY = {"type": "object", "properties": {"city": {"type": "string", "description": "A city"}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": CITY}}
         for n, d in (("get_weather", "Current weather"), ("get_time", "Local time"))]
ASK = [{"role": "user", "content": "Weather in Rome and time in Oslo?"}]
WEATHER, TIME = ("get_weather", '{"city": "Rome"}'), ("get_time", '{"city": "Oslo"}')
F32 = ("--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.05")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A call's pieces: its forced start, then the name (a choice) with what it forces, a city, the end.
START, END = '{"name": "get_', '"}}'
ARGS = {key: (f'weather", "{key}": {{"city": "', f'time", "{key}": {{"city": "') for key in ("arguments", "parameters")}
W, T = ARGS["arguments"]
CITIES = {W: ["Rome"], T: ["Oslo"]}

TEXT, OPEN, CLOSE, NEXT = "Let me check.\n", "<tool_call>\n", "\n</tool_call>", "\n<tool_call>\n" + START
HERMES = (scripted_vocab([TEXT, OPEN, CLOSE, NEXT, START, W, T, END, END + CLOSE, "Paris", "Rome", "Oslo"],
                         ["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML), {
    "Ċ": [TEXT, OPEN, "Paris"],  # the prompt ends in "assistant\n"
    TEXT: [OPEN, "<|im_end|>"], OPEN: ["Paris", START], START: ["Paris", W, T], **CITIES,
    "Rome": [END], END: [CLOSE], CLOSE: [NEXT, "<|im_end|>"],  # a second call where parallel calls are allowed
    NEXT: ["Paris", T], "Oslo": [END + CLOSE], END + CLOSE: ["<|im_end|>"], "Paris": ["<|im_end|>"],
})
WL, TL = ARGS["parameters"]
LLAMA = (scripted_vocab([START, WL, TL, END, "Paris", "Rome", "Oslo"],
                        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                         "<|python_tag|>"], "<|eot_id|>",
                        (DATA / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(encoding="utf-8")), {
    "Ċ": ["<|python_tag|>", "Paris", START],  # the prompt ends in "<|end_header_id|>\n\n"
    "<|python_tag|>": ["Paris", START], START: ["Paris", WL, TL], WL: ["Rome"], TL: ["Oslo"],
    "Rome": [END], "Oslo": [END], END: ["<|eot_id|>"], "Paris": ["<|eot_id|>"],
})
ARRAY, MORE = "[" + START, END + ", " + START
MISTRAL = (scripted_vocab([ARRAY, W, T, MORE, END + "]", "Paris", "Rome", "Oslo"],
                          ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>",
                          (DATA / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(encoding="utf-8")), {
    "[/INST]": ["[TOOL_CALLS]", "Paris"],
    "[TOOL_CALLS]": ["Paris", ARRAY], ARRAY: ["Paris", W, T], **CITIES,
    "Rome": [MORE, END + "]"], MORE: ["Paris", T], "Oslo": [END + "]"], END + "]": ["</s>"], "Paris": ["</s>"],
})


def _serve(tmp_path_factory, family, *args: str):
    vocab, script = family
    path = scripted_gguf(vocab, script, tmp_path_factory.mktemp("native") / "scripted.gguf")
    log = path.parent / "server.log"
    srv = ServerProcess("--model", str(path), *F32, *args, log_path=log).wait_ready()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0), vocab
    assert srv.terminate() == 0
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    yield from _serve(tmp_path_factory, HERMES, "--chat-template", str(DATA / "vllm-tool_chat_template_hermes.jinja"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield from _serve(tmp_path_factory, LLAMA)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    yield from _serve(tmp_path_factory, MISTRAL)


def _ask(client: openai.OpenAI, messages=ASK, **kwargs) -> tuple[dict, dict]:
    """The reply whole and streamed, each as {content, calls, finish_reason}; ids checked to agree."""
    kwargs = {"model": "scripted", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 30,
              **kwargs}
    done = client.chat.completions.create(**kwargs).choices[0]
    whole = {"content": done.message.content, "finish_reason": done.finish_reason,
             "calls": [(c.function.name, c.function.arguments) for c in done.message.tool_calls or []]}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, [d.id, d.function.name, ""])
            assert d.id in (None, call[0]) and (d.function.name is None or d.index == len(calls) - 1)
            call[2] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    streamed = {"content": content or None, "finish_reason": finish,
                "calls": [(name, args) for _, (_, name, args) in sorted(calls.items())]}
    for name, args in whole["calls"]:
        jsonschema.validate(json.loads(args), CITY)
    return whole, streamed


def _token(vocab, text: str) -> str:
    return str(vocab.tokens.index(text))


def test_hermes_auto_text_then_parallel_calls(hermes):
    client, vocab = hermes
    whole, streamed = _ask(client)
    # The whitespace before the first <tool_call> is the template's separator: not content.
    assert whole == streamed == {"content": "Let me check.", "finish_reason": "tool_calls", "calls": [WEATHER, TIME]}
    whole, streamed = _ask(client, parallel_tool_calls=False)
    assert whole == streamed == {"content": "Let me check.", "finish_reason": "tool_calls", "calls": [WEATHER]}
    whole, streamed = _ask(client, logit_bias={_token(vocab, OPEN): -100})
    assert whole == streamed == {"content": TEXT, "finish_reason": "stop", "calls": []}


def test_hermes_required_and_named(hermes):
    client, _ = hermes
    whole, streamed = _ask(client, tool_choice="required")
    assert whole == streamed == {"content": None, "finish_reason": "stop", "calls": [WEATHER, TIME]}
    whole, streamed = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert whole == streamed == {"content": None, "finish_reason": "stop", "calls": [TIME]}


def _agent_turn(client: openai.OpenAI, **kwargs) -> list:
    """A call, its results sent back in the history, and the next turn: the template renders them."""
    first = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=30,
                                           temperature=0, **kwargs)
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in message.tool_calls]
    again = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=30,
                                           temperature=0)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 10
    return message.tool_calls


def test_hermes_agent_loop(hermes):
    assert len(_agent_turn(hermes[0])) == 2  # tool results need `name` in this template: filled in


def test_llama3_json_call_with_or_without_python_tag(llama):
    client, vocab = llama
    whole, streamed = _ask(client)
    assert whole == streamed == {"content": None, "finish_reason": "tool_calls", "calls": [WEATHER]}
    tag = _token(vocab, "<|python_tag|>")
    whole, streamed = _ask(client, logit_bias={tag: -100})
    assert whole == streamed == {"content": "Paris", "finish_reason": "stop", "calls": []}
    # Forced without its tag, the model's next choice that is a call: the bare JSON.
    whole, streamed = _ask(client, tool_choice="required", logit_bias={tag: -100})
    assert whole == streamed == {"content": None, "finish_reason": "stop", "calls": [WEATHER]}
    whole, streamed = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert whole == streamed == {"content": None, "finish_reason": "stop", "calls": [TIME]}
    assert len(_agent_turn(client)) == 1
    # Meta's template renders one call per turn; a history with two is the template's own 400.
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
             for k in range(2)]
    with pytest.raises(openai.BadRequestError, match="only supports single tool-calls"):
        client.chat.completions.create(model="scripted", max_tokens=5, tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "tool_calls": calls}, {"role": "tool", "tool_call_id": "call_0", "content": "9"}])


def test_mistral_calls_in_one_array_with_nine_character_ids(mistral):
    client, vocab = mistral
    whole, streamed = _ask(client)
    assert whole == streamed == {"content": None, "finish_reason": "tool_calls", "calls": [WEATHER, TIME]}
    whole, streamed = _ask(client, parallel_tool_calls=False)  # the array holds one call
    assert whole == streamed == {"content": None, "finish_reason": "tool_calls", "calls": [WEATHER]}
    whole, streamed = _ask(client, logit_bias={_token(vocab, "[TOOL_CALLS]"): -100})
    assert whole == streamed == {"content": "Paris", "finish_reason": "stop", "calls": []}
    whole, streamed = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert whole == streamed == {"content": None, "finish_reason": "stop", "calls": [TIME]}
    calls = _agent_turn(client)  # Nemo's template refuses any id but 9 letters and digits
    assert len(calls) == 2 and all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls)
