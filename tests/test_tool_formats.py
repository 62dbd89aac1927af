"""The native tool-call formats without a model: which chat templates each is detected from (the
real templates in tests/data), how earlier calls and results render in them, what their grammars
accept and refuse (compiled by llguidance over a byte-level vocabulary), and how replies in each
format parse into calls, the same whatever pieces they arrive in."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from vinoserve.model.chat_template import render_chat
from vinoserve.scheduler.grammar import GrammarCompiler
from vinoserve.server.events import TextDelta, ToolCallDelta, ToolCallStart
from vinoserve.server.tools import FORMATS, ToolPlan, select_tool_format
from vinoserve.server.tools.mistral import mistral_id

DATA = Path(__file__).parent / "data"
TEMPLATES = {p.stem: p.read_text(encoding="utf-8") for p in DATA.glob("*.jinja")}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20, "description": "A city"}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather", "parameters": CITY}
TIME = {"name": "get_time", "description": "Local time", "parameters": CITY}
AUTO, REQUIRED = ToolPlan((WEATHER, TIME), False, True), ToolPlan((WEATHER, TIME), True, True)
SINGLE, NAMED = ToolPlan((WEATHER, TIME), False, False), ToolPlan((TIME,), True, False)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_8f2e6c1d0a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_8f2e6c1d0a", "content": "21 C"},
]


@pytest.mark.parametrize("template, expected", [
    ("Qwen-Qwen3-0.6B", "hermes"),
    ("vllm-tool_chat_template_hermes", "hermes"),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3_json"),
    ("vllm-tool_chat_template_llama3.1_json", "llama3_json"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ("vllm-tool_chat_template_mistral_parallel", "mistral"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "generic"),
])
def test_auto_detects_the_family_from_the_template(template, expected):
    assert select_tool_format("auto", TEMPLATES[template]).name == expected


def test_named_formats_and_the_fallback():
    assert list(FORMATS) == ["hermes", "llama3_json", "mistral", "harmony", "generic"]
    assert select_tool_format("hermes", "").name == "hermes"  # e.g. with --chat-template of one's own
    assert select_tool_format("auto", "{{ messages[0].content }}").name == "generic"
    qwen3_coder = "<tool_call>\n<function=get_weather>\n<parameter=city>"  # XML calls: not Hermes
    assert select_tool_format("auto", qwen3_coder).name == "generic"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        select_tool_format("pythonic", "")


def _render(template: str, messages: list[dict], plan: ToolPlan | None = AUTO) -> str:
    fmt = select_tool_format("auto", TEMPLATES[template])
    messages, extra = fmt.render(messages, plan, TEMPLATES[template])
    return render_chat(TEMPLATES[template], messages, bos_token="", eos_token="</s>", **extra)


@pytest.mark.parametrize("template, call", [
    # Earlier calls render as the model writes them: what the grammar holds a reply to.
    ("Qwen-Qwen3-0.6B", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("meta-llama-Llama-3.2-3B-Instruct", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
    ("vllm-tool_chat_template_llama3.1_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
    ("mistralai-Mistral-Nemo-Instruct-2407", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
])
def test_history_renders_in_the_family_format(template, call):
    text = _render(template, HISTORY)
    assert call in text and "get_time" in text  # the tools, listed by the template itself
    assert "21 C" in text


def test_hermes_tool_results_are_named_after_their_call():
    # vLLM's Hermes template refuses a tool result without `name`; OpenAI's messages carry none.
    text = _render("vllm-tool_chat_template_hermes", HISTORY)
    assert '<tool_response>\n{"name": "get_weather", "content": "21 C"}\n</tool_response>' in text


@pytest.mark.parametrize("template", ["mistralai-Mistral-Nemo-Instruct-2407",
                                      "vllm-tool_chat_template_mistral_parallel"])
def test_mistral_call_ids_are_nine_alphanumerics_on_both_sides(template):
    text = _render(template, HISTORY)
    short = mistral_id("call_8f2e6c1d0a")
    assert re.fullmatch("[A-Za-z0-9]{9}", short) and mistral_id("call_8f2e6c1d0a") == short
    assert f'"id": "{short}"' in text and f'"call_id": "{short}"' in text
    assert mistral_id("Ab3dE6gH9") == "Ab3dE6gH9"  # ids this format gave are kept
    assert re.fullmatch("[A-Za-z0-9]{9}", FORMATS["mistral"].new_id())


def test_a_template_that_joins_arguments_to_text_renders_them_as_json():
    # DeepSeek-R1's template writes '```json\n' + arguments + '\n```'.
    text = _render("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", HISTORY)
    assert '```json\n{"city": "Paris"}\n```' in text


# A byte-level vocabulary with the tags as special tokens, or without them (spelled out as text).
SPECIAL = ["[TOOL_CALLS]", "<|python_tag|>", "<|eos|>"]
VOCAB = [bytes([b]) for b in range(256)] + [s.encode() for s in SPECIAL]
IDS = {s: 256 + k for k, s in enumerate(SPECIAL)}
EOS = IDS["<|eos|>"]
COMPILER = GrammarCompiler(VOCAB, len(VOCAB), [EOS], list(IDS.values()), lambda s: list(s.encode()))


def _accepts(fmt, plan: ToolPlan, pieces: list[str]) -> bool:
    """Whether the format's grammar for `plan` takes this whole reply (a special tag as its token)."""
    matcher = COMPILER.matcher(fmt.grammar(plan)).matcher
    tokens = [t for p in pieces for t in ([IDS[p]] if p in IDS and fmt.special_tokens else list(p.encode()))]
    return all(matcher.consume_token(t) for t in tokens + [EOS]) and not matcher.is_error()


H_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
M_BOTH = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
          '{"name": "get_time", "arguments": {"city": "Rome"}}]')
M_TIME = '[{"name": "get_time", "arguments": {"city": "Rome"}}]'


@pytest.mark.parametrize("name, plan, pieces, accepted", [
    ("hermes", AUTO, ["Sure."], True),
    ("hermes", AUTO, [""], True),
    ("hermes", AUTO, ["Let me look.\n", H_WEATHER, "\n", H_TIME], True),
    ("hermes", AUTO, ["Text <tool_call>\nnot json"], False),  # once opened, a call must follow
    ("hermes", AUTO, [H_WEATHER, " and more text"], False),
    ("hermes", AUTO, ['<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'], False),
    ("hermes", SINGLE, [H_WEATHER, "\n", H_TIME], False),  # parallel_tool_calls: false
    ("hermes", REQUIRED, ["Sure."], False),
    ("hermes", REQUIRED, [H_WEATHER, "\n", H_TIME], True),
    ("hermes", NAMED, [H_WEATHER], False),
    ("hermes", NAMED, [H_TIME], True),
    ("llama3_json", AUTO, ["Paris is sunny."], True),
    ("llama3_json", AUTO, [""], True),
    ("llama3_json", AUTO, [L_WEATHER], True),
    ("llama3_json", AUTO, ["<|python_tag|>", L_WEATHER], True),
    ("llama3_json", AUTO, ['{"name": "nope"}'], False),
    ("llama3_json", AUTO, ["<|python_tag|>", "hello"], False),
    ("llama3_json", AUTO, [L_WEATHER, "; ", L_WEATHER], False),  # one call a turn
    ("llama3_json", REQUIRED, ["Paris is sunny."], False),
    ("llama3_json", NAMED, [L_WEATHER], False),
    ("mistral", AUTO, ["Paris is sunny."], True),
    ("mistral", AUTO, ["[TOOL_CALLS]", M_BOTH], True),
    ("mistral", AUTO, ["Checking. ", "[TOOL_CALLS]", " ", M_TIME], True),
    ("mistral", AUTO, ["[TOOL_CALLS]", '[{"name": "get_weather"}]'], False),
    ("mistral", SINGLE, ["[TOOL_CALLS]", M_BOTH], False),
    ("mistral", SINGLE, ["[TOOL_CALLS]", M_TIME], True),
    ("mistral", REQUIRED, ["Paris."], False),
    ("mistral", NAMED, ["[TOOL_CALLS]", M_TIME], True),
])
@pytest.mark.parametrize("special", [True, False], ids=["tag-token", "tag-text"])
def test_grammar_holds_replies_to_the_format(name, plan, pieces, accepted, special):
    fmt = FORMATS[name]({s: IDS[s] for s in SPECIAL} if special else None)
    assert fmt.skip_special_tokens == (name == "hermes" or not special)  # to see a special tag, keep it
    assert _accepts(fmt, plan, pieces) is accepted


def test_tool_parameters_with_defs_compile_in_every_format():
    # pydantic puts nested models under $defs, referred to from inside the parameters.
    params = {"$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
              "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"]}
    plan = ToolPlan(({"name": "visit", "parameters": params}, {"name": "stay", "parameters": params}), False, True)
    for fmt in FORMATS.values():
        for forced in (False, True):  # harmony leaves auto free (None)
            if (spec := fmt().grammar(replace(plan, forced=forced))) is not None:
                COMPILER.compile(spec)
    assert _accepts(FORMATS["hermes"](), plan, [
        '<tool_call>\n{"name": "stay", "arguments": {"place": {"city": "Oslo"}}}\n</tool_call>'])


def _parse(name: str, plan: ToolPlan, text: str, size: int) -> tuple[str, list[tuple[str, str]], set[str]]:
    parser = FORMATS[name]().parser(plan)
    events = [e for k in range(0, len(text), size) for e in parser.feed(text[k:k + size])] + parser.finish()
    assert all(e.text for e in events if isinstance(e, TextDelta)) and parser.made_calls == any(
        isinstance(e, ToolCallStart) for e in events)
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.call_index] = [e.name, ""]
        elif isinstance(e, ToolCallDelta):
            calls[e.call_index][1] += e.arguments
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return content, [tuple(c) for _, c in sorted(calls.items())], {e.id for e in events if isinstance(e, ToolCallStart)}


PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome"}'


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", f"Let me look.\n{H_WEATHER}\n{H_TIME}", "Let me look.", [("get_weather", PARIS), ("get_time", ROME)]),
    ("hermes", H_WEATHER, "", [("get_weather", PARIS)]),
    ("hermes", "a < b, and <tool_cal is not a tag \n", "a < b, and <tool_cal is not a tag \n", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ("llama3_json", L_WEATHER, "", [("get_weather", PARIS)]),
    ("llama3_json", f"<|python_tag|>{L_WEATHER}", "", [("get_weather", PARIS)]),
    ("llama3_json", f'{{"name": "get_weather", "arguments": {PARIS}}}', "", [("get_weather", PARIS)]),
    ("llama3_json", f"Sure: {L_WEATHER}", f"Sure: {L_WEATHER}", []),  # calls only open a reply
    ("llama3_json", "<|python", "<|python", []),
    ("mistral", f"[TOOL_CALLS]{M_BOTH}", "", [("get_weather", PARIS), ("get_time", ROME)]),
    ("mistral", f"Checking.  [TOOL_CALLS] {M_TIME}", "Checking.", [("get_time", ROME)]),
    ("mistral", "Plain [TOOL_CALL", "Plain [TOOL_CALL", []),
])
def test_replies_parse_the_same_in_any_pieces(name, text, content, calls):
    for size in range(1, len(text) + 1):
        got_content, got_calls, ids = _parse(name, AUTO, text, size)
        assert (got_content, got_calls) == (content, calls), size
        assert len(ids) == len(calls)
        assert all(re.fullmatch("[A-Za-z0-9]{9}" if name == "mistral" else "call_[0-9a-f]{24}", i) for i in ids)


def test_arguments_stream_before_the_call_ends():
    parser = FORMATS["hermes"]().parser(AUTO)
    pieces = ["<tool_call>\n", '{"name": "get_weather"', ', "arguments": {"ci', 'ty": "Par', 'is"}}\n</tool_call>']
    steps = [parser.feed(p) for p in pieces]
    assert steps[0] == [] and [type(e) for e in steps[1]] == [ToolCallStart]
    assert [e.arguments for step in steps[2:] for e in step] == ['{"ci', 'ty": "Par', 'is"}']
    assert json.loads("".join(e.arguments for step in steps[2:] for e in step)) == {"city": "Paris"}
