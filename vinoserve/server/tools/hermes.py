"""Hermes tool calls (Qwen2.5, Qwen3, QwQ, NousResearch Hermes 2 Pro / 3): each call in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

blocks one after another, separated by a newline, optionally after some text (which stays
`content`). The chat template lists the tools and renders earlier calls and `<tool_response>`s.
"""
from __future__ import annotations

from collections.abc import Mapping

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.tools.native import CallSyntax, NativeFormat, json_rule, tagged_grammar
from vinoserve.server.tools.plan import ToolPlan, calls_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(NativeFormat):
    name = "hermes"
    syntax = CallSyntax(opening=(OPEN,))

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        super().__init__(special_tokens)
        self.open, self.close = self.tag(OPEN), self.tag(CLOSE)

    @classmethod
    def detect(cls, template: str) -> bool:
        # Qwen3-Coder's template also says <tool_call>, but its calls are XML (<function=...>).
        return OPEN in template and "<function=" not in template

    def grammar(self, plan: ToolPlan) -> GrammarSpec:
        block = f'"\\n" {json_rule(calls_schema(plan.functions))} "\\n" {self.close.lark()}'
        calls = f'call ("\\n" {self.open.lark()} call)*' if plan.parallel else "call"
        return tagged_grammar(self.open, calls, f"call: {block}", plan.forced)
