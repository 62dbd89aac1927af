"""Request fields that constrain the output -> a GrammarSpec, compiled before the request queues."""
from __future__ import annotations

import asyncio
import json

from vinoserve.scheduler.grammar import GrammarCompiler, GrammarSpec
from vinoserve.server.errors import APIError

# vLLM's structured_outputs keys -> our grammar kinds
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def requested_grammar(req) -> tuple[GrammarSpec, str] | None:
    """The constraint a request asks for and the field that asked; 400 for malformed or clashing ones."""
    found: list[tuple[GrammarSpec, str]] = []
    if (fmt := req.response_format) is not None:
        if (spec := _response_format(fmt)) is not None:
            found.append((spec, "response_format"))
    if (so := req.structured_outputs) is not None:
        found += [(s, "structured_outputs") for s in _structured_outputs(so)]
    legacy = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
              "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar}
    for name, value in legacy.items():
        if value is not None:
            found += [(s, name) for s in _structured_outputs({name.removeprefix("guided_"): value}, name)]
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not {', '.join(f for _, f in found)}", found[1][1])
    return found[0] if found else None


def _response_format(fmt: dict) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema", {}), (dict, bool)):
            raise APIError(400, "response_format.json_schema must be an object with a `schema` object",
                           "response_format")
        return GrammarSpec.json_schema(body.get("schema", {}))
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                   "response_format")


def _structured_outputs(so: dict, param: str = "structured_outputs") -> list[GrammarSpec]:
    if not isinstance(so, dict):
        raise APIError(400, f"{param} must be an object", param)
    specs = []
    for key, value in so.items():
        if value is None or key in ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties"):
            continue
        if key == "json_object":
            if value:
                specs.append(GrammarSpec.json_schema({"type": "object"}))
        elif key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise APIError(400, f"{param}: json is not a JSON schema: {e}", param) from e
            specs.append(GrammarSpec.json_schema(value))
        elif key in _STRUCTURED_KEYS:
            text = json.dumps(value) if key == "choice" else value
            if not isinstance(text, str):
                raise APIError(400, f"{param}: {key} must be a string", param)
            specs.append(GrammarSpec(_STRUCTURED_KEYS[key], text))
        else:
            raise APIError(400, f"{param}: {key!r} is not supported "
                           f"(json, json_object, regex, choice, grammar)", param)
    return specs


async def compile_grammar(compiler: GrammarCompiler, spec: GrammarSpec, param: str, what: str | None = None) -> None:
    """Compile in a worker thread (the cache makes the engine's own lookup free); 400 if it cannot."""
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except ValueError as e:
        raise APIError(400, f"invalid {what or param}: {e}", param) from e


async def grammar_for(req, compiler: GrammarCompiler) -> GrammarSpec | None:
    """The request's compiled output constraint (from its format fields), or None."""
    found = requested_grammar(req)
    if found is None:
        return None
    await compile_grammar(compiler, *found)
    return found[0]
