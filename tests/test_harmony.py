"""gpt-oss's harmony format without a model: detected from gpt-oss's real chat template
(tests/data/openai-gpt-oss-120b.jinja, from llama.cpp's models/templates), earlier reasoning,
calls and results rendered back through it, replies split into reasoning, content and tool calls
the same whatever pieces they arrive in (through the reasoning parser and then the tool parser, as
the server runs them, or the tool parser alone), the grammars for forced calls and for
response_format (compiled by llguidance over a byte-level vocabulary with the tags as special
tokens), and the stop tokens a gpt-oss GGUF gets."""
from __future__ import annotations

from pathlib import Path

import pytest

from vinoserve.model.chat_template import render_chat
from vinoserve.model.gguf_tokenizer import TokenizerMetadata
from vinoserve.scheduler.grammar import GrammarCompiler, GrammarSpec
from vinoserve.server.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart
from vinoserve.server.harmony import TAGS, HarmonyParser
from vinoserve.server.reasoning import Start, select_reasoning
from vinoserve.server.tools import ToolPlan, select_tool_format
from vinoserve.server.tools.harmony import Harmony

TEMPLATE = (Path(__file__).parent / "data" / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather", "parameters": CITY}
TIME = {"name": "get_time", "parameters": CITY}  # no description: the template still renders it
AUTO, REQUIRED, NAMED = ToolPlan((WEATHER, TIME), False, True), ToolPlan((WEATHER, TIME), True, True), \
    ToolPlan((TIME,), True, False)
PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome"}'


def _call(call_id: str, name: str, args: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def test_auto_selects_harmony_from_gpt_oss_template():
    assert select_tool_format("auto", TEMPLATE).name == "harmony"
    assert select_reasoning("auto", TEMPLATE).name == "harmony"
    assert select_reasoning("harmony", "").name == "harmony"  # --reasoning-parser harmony
    assert select_tool_format("auto", "{{ messages[0].content }}").name == "generic"


def _render(messages: list[dict], plan: ToolPlan | None = AUTO) -> str:
    messages, extra = Harmony().render(messages, plan, TEMPLATE)
    return render_chat(TEMPLATE, messages, add_generation_prompt=True, **extra)


def test_history_renders_reasoning_calls_and_results_as_gpt_oss_writes_them():
    text = _render([
        {"role": "user", "content": "Weather in Paris and time in Rome?"},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools needed.",
         "tool_calls": [_call("c1", "get_weather", PARIS), _call("c2", "get_time", ROME)]},
        # results in another order than the calls: each must follow its own call
        {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ])
    assert "type get_time = (_: {" in text and "// Current weather" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Two tools needed.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>'
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
            '{"city": "Rome"}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"10:00"<|end|>'
            "<|start|>assistant") in text
    assert text.endswith("<|start|>assistant")


def test_earlier_answers_render_without_their_reasoning_and_without_tools_declared():
    text = _render([{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back.", "tool_calls": []},
                    {"role": "user", "content": "Bye"}], None)
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert "Greet back." not in text and "# Tools" not in text


def _split(text: str, size: int, tools: bool, reasoning: bool = True) -> list:
    """Events for `text` fed in pieces of `size` characters, through the reasoning parser and then
    the tool parser as the server runs them, adjacent deltas of a kind joined."""
    first = HarmonyParser() if reasoning else None
    second = HarmonyParser(lambda: "call_x") if tools else None
    events = []
    for piece in [text[k:k + size] for k in range(0, len(text), size)] + [None]:
        out = (first.feed(piece) if piece is not None else first.finish()) if first else [TextDelta(piece or "")]
        for e in out:
            if isinstance(e, TextDelta) and second is not None:
                events += second.feed(e.text)
            else:
                events.append(e)
        if piece is None and second is not None:
            events += second.finish()
    joined = []
    for e in events:
        if isinstance(e, TextDelta) and not e.text:
            continue
        if joined and type(e) is type(joined[-1]) and isinstance(e, (TextDelta, ReasoningDelta)):
            joined[-1] = type(e)(joined[-1].text + e.text)
        elif joined and isinstance(e, ToolCallDelta) and isinstance(joined[-1], ToolCallDelta):
            joined[-1] = ToolCallDelta(e.call_index, joined[-1].arguments + e.arguments)
        else:
            joined.append(e)
    return joined


ANALYSIS = "<|channel|>analysis<|message|>The user wants a city. <b>|end</b><|end|>"
CASES = [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Paris.",
     [ReasoningDelta("The user wants a city. <b>|end</b>"), TextDelta("Paris.")]),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     + PARIS, [ReasoningDelta("The user wants a city. <b>|end</b>"), ToolCallStart(0, "call_x", "get_weather"),
               ToolCallDelta(0, PARIS)]),
    # the recipient in the role part, as the template renders earlier calls; then a second call
    (" to=functions.get_weather<|channel|>commentary json<|message|>" + PARIS + "<|call|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>" + ROME,
     [ToolCallStart(0, "call_x", "get_weather"), ToolCallDelta(0, PARIS),
      ToolCallStart(1, "call_x", "get_time"), ToolCallDelta(1, ROME)]),
    # a preamble on the commentary channel is content; a reply cut short in its analysis is reasoning
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     [TextDelta("Let me check."), TextDelta("Done.")]),
    ("<|channel|>analysis<|message|>Hmm, <|ch", [ReasoningDelta("Hmm, <|ch")]),
    # cut short in a header: it opened no message; text that never became a tag is text
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fin", [ReasoningDelta("Hmm.")]),
    ("Plain <b>", [TextDelta("Plain <b>")]),
    ("<", [TextDelta("<")]),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_replies_split_the_same_in_any_pieces(text, expected):
    expected = _joined(expected)
    for size in range(1, len(text) + 1):
        assert _split(text, size, tools=True) == expected, size
        assert _split(text, size, tools=True, reasoning=False) == expected, size  # --reasoning-parser none


def _joined(events: list) -> list:
    out = []
    for e in events:
        if out and isinstance(e, TextDelta) and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def test_without_tools_a_call_stays_text_and_reasoning_is_still_split():
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    assert _split(text, 3, tools=False) == [
        ReasoningDelta("The user wants a city. <b>|end</b>"),
        TextDelta("<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}")]


def test_made_calls_says_whether_a_call_came():
    parser = Harmony().parser(AUTO)
    parser.feed("<|channel|>final<|message|>Paris")
    assert not parser.made_calls
    parser.feed("<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}")
    assert parser.made_calls and parser.finish() == []


VOCAB = [bytes([b]) for b in range(256)] + [t.encode() for t in TAGS]
IDS = {t: 256 + k for k, t in enumerate(TAGS)}
STOPS = [IDS["<|return|>"], IDS["<|call|>"]]
COMPILER = GrammarCompiler(VOCAB, len(VOCAB), STOPS, list(IDS.values()), lambda s: list(s.encode()))


def _accepts(spec: GrammarSpec, text: str, stop: str = "<|call|>") -> bool:
    """Whether `spec` takes this whole reply, each tag as its special token, then a stop token."""
    matcher = COMPILER.matcher(spec).matcher
    tokens, rest = [], text
    while rest:
        tag = next((t for t in TAGS if rest.startswith(t)), None)
        tokens += [IDS[tag]] if tag else list(rest[0].encode())
        rest = rest[len(tag) if tag else 1:]
    return all(matcher.consume_token(t) for t in tokens + [IDS[stop]]) and not matcher.is_error()


IN_CHANNEL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}"
IN_ROLE = " to=functions.{}<|channel|>commentary json<|message|>{}"


@pytest.mark.parametrize("plan, text, accepted", [
    (REQUIRED, IN_CHANNEL.format("get_weather", PARIS), True),
    (REQUIRED, ANALYSIS + "<|start|>assistant" + IN_CHANNEL.format("get_time", ROME), True),
    (REQUIRED, IN_ROLE.format("get_weather", PARIS), True),
    (REQUIRED, IN_CHANNEL.format("get_weather", '{"town": "Paris"}'), False),
    (REQUIRED, IN_CHANNEL.format("get_date", PARIS), False),
    (REQUIRED, "<|channel|>final<|message|>Paris.", False),
    (REQUIRED, ANALYSIS, False),
    (NAMED, IN_CHANNEL.format("get_weather", PARIS), False),
    (NAMED, IN_CHANNEL.format("get_time", ROME), True),
])
def test_forced_call_grammar(plan, text, accepted):
    fmt = Harmony({t: IDS[t] for t in TAGS})
    assert not fmt.skip_special_tokens and Harmony().skip_special_tokens  # tags as tokens: kept in the text
    assert _accepts(fmt.grammar(plan), text) is accepted
    assert Harmony().grammar(AUTO) is None  # auto: free


@pytest.mark.parametrize("text, accepted", [
    ("<|channel|>final<|message|>" + PARIS, True),
    ("<|channel|>final <|constrain|>json<|message|>" + PARIS, True),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + PARIS, True),
    ("<|channel|>final<|message|>Paris", False),
    (IN_CHANNEL.format("get_weather", PARIS), False),
])
def test_response_format_holds_the_final_message_after_any_analysis(text, accepted):
    fmt = select_reasoning("harmony", "", {t: IDS[t] for t in TAGS})
    assert not fmt.skip_special_tokens
    spec = fmt.constrain(GrammarSpec.json_schema(CITY), fmt.start_state("<|start|>assistant"))
    assert _accepts(spec, text, "<|return|>") is accepted
    tools = Harmony(dict(IDS)).grammar(REQUIRED)
    assert fmt.constrain(tools, Start.UNOPENED, tools=True) == tools  # a tool grammar frames itself


def test_gpt_oss_gguf_stops_on_return_and_call_but_not_end():
    tokens = ["a", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    meta = TokenizerMetadata(model="gpt2", pre=None, tokens=tokens, token_types=[1, 3, 3, 3, 3], scores=None,
                             merges=[], bos_token_id=None, eos_token_id=2, unk_token_id=None, pad_token_id=4,
                             eot_token_id=1, eom_token_id=None, add_bos_token=False, add_eos_token=False,
                             add_space_prefix=False, chat_template=None)
    assert meta.eos_token_ids == [2, 3]


def test_grammars_hold_tags_spelled_as_text_where_they_are_not_special_tokens():
    text_vocab = [bytes([b]) for b in range(256)] + [b"<eos>"]
    compiler = GrammarCompiler(text_vocab, len(text_vocab), [256], [256], lambda s: list(s.encode()))
    reply = (ANALYSIS + "<|start|>assistant" + IN_CHANNEL.format("get_time", ROME)).encode()
    for spec, good in [(Harmony().grammar(REQUIRED), reply),
                       (select_reasoning("harmony", "").constrain(GrammarSpec.json_schema(CITY), Start.UNOPENED),
                        ("<|channel|>final<|message|>" + PARIS).encode())]:
        matcher = compiler.matcher(spec).matcher
        assert all(matcher.consume_token(b) for b in good) and matcher.consume_token(256)
        bad = compiler.matcher(spec).matcher
        assert not all(bad.consume_token(b) for b in good.replace(b"<|message|>", b"<|massage|>", 1))
