"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is one call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

which the model may open with `<|python_tag|>` (a special token); a reply that does not begin
with either is text. Meta's templates render one call per assistant turn (they raise on more),
so a reply holds one call whatever `parallel_tool_calls` says. The template lists the tools
(in the first user turn by default) and renders results under the `ipython` role.
"""
from __future__ import annotations

from collections.abc import Mapping

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.tools.native import CallSyntax, NativeFormat, json_rule
from vinoserve.server.tools.plan import ToolPlan, calls_schema

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(NativeFormat):
    name = "llama3_json"
    syntax = CallSyntax(opening=(PYTHON_TAG,), leading=True, bare_json=True, arguments=("parameters", "arguments"))

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        super().__init__(special_tokens)
        self.python_tag = self.tag(PYTHON_TAG)

    @classmethod
    def detect(cls, template: str) -> bool:
        return "<|start_header_id|>ipython<|end_header_id|>" in template

    def grammar(self, plan: ToolPlan) -> GrammarSpec:
        rules = f"call: {json_rule(calls_schema(plan.functions, 'parameters'))}"
        if plan.forced:
            return GrammarSpec("lark", f"start: {self.python_tag.lark()}? call\n{rules}")
        # Text may be empty, but may not begin as a call: "{", or the tag where it is plain text.
        text = "TEXT: /([^{](.|\\n)*)?/"
        if self.python_tag.token is None:
            text += " & ~/<\\|python_tag\\|>(.|\\n)*/"
        return GrammarSpec("lark", f"start: TEXT | {self.python_tag.lark()}? call\n{rules}\n{text}")
