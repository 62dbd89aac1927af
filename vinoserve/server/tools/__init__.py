"""Tool calling: the request's plan (plan.py), and the formats models write calls in, one module
each behind the interface in format.py. `--tool-call-parser` names one of FORMATS, or `auto`:
the first whose `detect` accepts the chat template, else generic."""
from __future__ import annotations

from collections.abc import Mapping

from vinoserve.server.tools.format import ToolCallParser, ToolFormat
from vinoserve.server.tools.generic import GenericFormat
from vinoserve.server.tools.harmony import Harmony
from vinoserve.server.tools.hermes import Hermes
from vinoserve.server.tools.llama3 import Llama3Json
from vinoserve.server.tools.mistral import Mistral
from vinoserve.server.tools.plan import ToolPlan, tool_plan

# Tried in this order by auto (Hermes 2 Pro on Llama 3 has both Hermes and Llama 3 markers; its
# calls are Hermes'); generic, the fallback, last.
FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, Harmony, GenericFormat)}
CHOICES = ("auto", *FORMATS)


def select_tool_format(name: str, template: str, special_tokens: Mapping[str, int] | None = None) -> ToolFormat:
    """The format `--tool-call-parser NAME` means for a model with this chat template and these
    special tokens (by text)."""
    if name == "auto":
        found = next((f for f in FORMATS.values() if f.detect(template)), GenericFormat)
        return found(special_tokens)
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(CHOICES)}; got {name!r}")
    return FORMATS[name](special_tokens)


__all__ = ["CHOICES", "FORMATS", "ToolCallParser", "ToolFormat", "ToolPlan", "select_tool_format", "tool_plan"]
