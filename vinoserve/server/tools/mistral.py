"""Mistral tool calls (Mistral 7B v0.3, Nemo, Small 3 / 3.1): all calls in one JSON array after
the `[TOOL_CALLS]` token (a space may come between),

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

optionally after some text. Mistral's templates require call ids of 9 letters and digits (Nemo's
exactly 9), on earlier calls and on the results that answer them: the ids this format gives are
such, and ids a client made elsewhere are mapped onto such, the same way on both sides.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Mapping

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.server.tools.native import CallSyntax, NativeFormat, json_rule, tagged_grammar
from vinoserve.server.tools.plan import ToolPlan, calls_schema

TOOL_CALLS = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


class Mistral(NativeFormat):
    name = "mistral"
    syntax = CallSyntax(opening=(TOOL_CALLS,), array=True)

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        super().__init__(special_tokens)
        self.open = self.tag(TOOL_CALLS)

    @classmethod
    def detect(cls, template: str) -> bool:
        # Newer templates (Magistral, Devstral, Small 3.2) write `[TOOL_CALLS]name[ARGS]{...}` instead.
        return TOOL_CALLS in template and "[ARGS]" not in template

    def render(self, messages: list[dict], plan: ToolPlan | None, template: str) -> tuple[list[dict], dict]:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "id": mistral_id(c.get("id"))} for c in m["tool_calls"]]}
            if m.get("role") == "tool":
                m = {**m, "tool_call_id": mistral_id(m.get("tool_call_id"))}
            out.append(m)
        return super().render(out, plan, template)

    def grammar(self, plan: ToolPlan) -> GrammarSpec:
        call = calls_schema(plan.functions)
        calls = {"type": "array", "items": {"anyOf": call["anyOf"]}, "minItems": 1,
                 **({} if plan.parallel else {"maxItems": 1}), **({"$defs": call["$defs"]} if "$defs" in call else {})}
        return tagged_grammar(self.open, f'" "? {json_rule(calls)}', "", plan.forced)

    @staticmethod
    def new_id() -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def mistral_id(call_id: str | None) -> str:
    """A call id as Mistral's templates take it: 9 letters and digits; any other id always maps
    to the same such id (a call and the result that answers it still match)."""
    call_id = call_id or ""
    if re.fullmatch("[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]
