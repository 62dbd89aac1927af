"""Tool calling: the request's plan (plan.py), and the formats models write calls in, one module
each behind the interface in format.py. `--tool-call-parser` names one of FORMATS, or `auto`:
the first whose `detect` accepts the chat template, else generic."""
from __future__ import annotations

from vinoserve.server.tools.format import ToolCallParser, ToolFormat
from vinoserve.server.tools.generic import GenericFormat
from vinoserve.server.tools.plan import ToolPlan, tool_plan

# Tried in this order by auto; generic, the fallback, last.
FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (GenericFormat,)}
CHOICES = ("auto", *FORMATS)


def select_tool_format(name: str, template: str) -> ToolFormat:
    """The format `--tool-call-parser NAME` means for a model with this chat template."""
    if name == "auto":
        return next((f() for f in FORMATS.values() if f.detect(template)), GenericFormat())
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(CHOICES)}; got {name!r}")
    return FORMATS[name]()


__all__ = ["CHOICES", "FORMATS", "ToolCallParser", "ToolFormat", "ToolPlan", "select_tool_format", "tool_plan"]
