"""A chat request's prompt text from the chat template, where a template that raises (its own
raise_exception, a jinja error, or Python's TypeError and kin on values it did not expect) is the
client's 400 naming the template, and the chat_template_kwargs entry it failed on where one did.

Templates are code from the model's files (or --chat-template) run on the request's values:
`{{ enable_thinking | length }}` given a boolean raises TypeError inside jinja, which no schema
of ours can foresee."""
from __future__ import annotations

from collections.abc import Callable

from vinoserve.server.errors import APIError

# What a template run on values it did not expect raises (jinja's TemplateError arrives as
# model/chat_template.py's ChatTemplateError, a ValueError).
TEMPLATE_FAULTS = (ValueError, TypeError, LookupError, ArithmeticError, AttributeError, RecursionError)

Render = Callable[[dict], str]  # the prompt text with these chat_template_kwargs


def render_prompt(render: Render, kwargs: dict, template_name: str) -> str:
    """`render(kwargs)`, or the 400 saying which template failed, on what and why."""
    try:
        return render(kwargs)
    except TEMPLATE_FAULTS as e:
        why = _describe(e)
    param = _blame(render, kwargs)
    name = param.removeprefix("chat_template_kwargs.")
    on = f" with {name}={kwargs[name]!r}" if name != param else ""
    raise APIError(400, f"{param}: {template_name} failed{on}: {why}", param)


def _describe(e: BaseException) -> str:
    message = str(e).removeprefix("chat template failed: ")
    return message if isinstance(e, ValueError) else f"{type(e).__name__}: {message}"


def _fails(render: Render, kwargs: dict) -> bool:
    try:
        render(kwargs)
    except TEMPLATE_FAULTS:
        return True
    return False


def _blame(render: Render, kwargs: dict) -> str:
    """The parameter to name: messages when the template fails without chat_template_kwargs, else
    the one entry it fails on (found by halving: a few renders, on the error path only), else all."""
    if not kwargs or _fails(render, {}):
        return "messages"
    names = list(kwargs)
    while len(names) > 1:
        half = names[:len(names) // 2]
        names = half if _fails(render, {k: kwargs[k] for k in half}) else names[len(half):]
    return f"chat_template_kwargs.{names[0]}" if _fails(render, {names[0]: kwargs[names[0]]}) \
        else "chat_template_kwargs"
