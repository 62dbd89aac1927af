"""gpt-oss tool calls in OpenAI's harmony format (server/harmony.py): a message on the commentary
channel to a recipient, its body the arguments as JSON,

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(or with the recipient in the role part, `to=functions.get_weather<|channel|>commentary json`, as the
chat template renders earlier calls). `<|call|>` ends the reply, so a reply holds one call; the
client runs it and the next turn may call again. Any analysis (reasoning) may come first.

The chat template (gpt-oss's own) renders one call per assistant message, reads earlier reasoning
from `thinking`, and names each tool result after the call just before it: `render` gives it
messages in that shape.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE, HarmonyParser, analysis_rules, lark_tag
from vinoserve.server.tools.format import ToolFormat, native_messages
from vinoserve.server.tools.native import json_rule
from vinoserve.server.tools.plan import ToolPlan, new_call_id


class Harmony(ToolFormat):
    name = "harmony"

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        super().__init__(special_tokens)
        # The tags are special tokens in gpt-oss's tokenizer: the parser must see them.
        self.skip_special_tokens = CHANNEL not in self.special_tokens

    @classmethod
    def detect(cls, template: str) -> bool:
        return CHANNEL in template and CALL in template

    def render(self, messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
        tools = [{**t, "function": {"description": "", **t["function"]}} for t in plan.tools_variable()] if plan else []
        return native_messages(harmony_messages(messages)), ({"tools": tools} if plan else {})

    def grammar(self, plan: ToolPlan) -> GrammarSpec | None:
        """Forced: one analysis message at most (llama.cpp allows any number, but a model free to
        reopen the analysis after each would never have to call), then one call to one of the
        functions, its arguments held to its schema (the stop tokens, `<|call|>` among them, end
        it). Auto: unconstrained."""
        if not plan.forced:
            return None
        tag = partial(lark_tag, special_tokens=self.special_tokens)
        kind = f'(" "? {tag(CONSTRAIN)}? "json")?'
        rules = []
        for i, f in enumerate(plan.functions):
            to = f'"to=functions.{f["name"]}"'
            parameters = f.get("parameters") or {"type": "object", "properties": {}}
            rules.append(f'call{i}: ({tag(CHANNEL)} "commentary " {to} | " " {to} {tag(CHANNEL)} "commentary") '
                         f'{kind} {tag(MESSAGE)} {json_rule(parameters)}')
        calls = " | ".join(f"call{i}" for i in range(len(rules)))
        return GrammarSpec("lark", f"start: (analysis next)? ({calls})\n" + "\n".join(rules) + "\n"
                           + analysis_rules(self.special_tokens))

    def parser(self, plan: ToolPlan) -> HarmonyParser:
        return HarmonyParser(new_call_id)


def harmony_messages(messages: list[dict]) -> list[dict]:
    """Messages as gpt-oss's template takes them: an assistant turn's reasoning as `thinking` (its
    content then left out beside calls: the template takes one or the other), and a turn of
    several calls split into one message per call, each followed by the results that answer it."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        if not m.get("tool_calls"):
            m.pop("tool_calls", None)  # the template reads any `tool_calls` key as a call
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m.pop("reasoning_content")
            if m.get("tool_calls"):
                m.pop("content", None)
        calls = m.get("tool_calls") or []
        if len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        left = list(results)
        for k, call in enumerate(calls):
            out.append({**m, "tool_calls": [call]} if k == 0 else {"role": "assistant", "tool_calls": [call]})
            answers = [r for r in left if r.get("tool_call_id") == call.get("id")] or left[:1]
            out += answers
            left = [r for r in left if all(r is not a for a in answers)]
        out += left
    return out
