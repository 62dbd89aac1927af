"""Render a model's chat template the way HF `apply_chat_template` does (sandboxed jinja2)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's override: jinja2's own tojson escapes HTML and sorts keys, which changes prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                **variables) -> str:
    """`variables` are the other names templates use: bos_token, eos_token, tools, ..."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
