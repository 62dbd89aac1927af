"""What the OpenAPI document states beyond each field's type: rules that span fields, as
server/structured.py, server/tools/plan.py and the engine check them, and markers the document
narrows for the server as it runs (server/openapi.py). Whatever a schema can state is stated, so
that a request the document calls valid is one the server takes; docs/reliability.md names the
400s no JSON schema can state."""
from __future__ import annotations

from vinoserve.cache.eviction import AGGREGATIONS, POLICIES

# The OpenAPI document narrows a field so marked, for a model that does not reason, to the
# marker's schema.
WITHOUT_REASONING = "x-without-reasoning"
# Likewise, on a server without cache eviction (--cache-eviction), and for a model without
# fill-in-the-middle tokens.
WITHOUT_EVICTION = "x-without-eviction"
WITHOUT_FIM = "x-without-fim"
WITHOUT_IMAGES = "x-without-images"  # a model served without a vision projector: image parts go


def limit(keyword: str, name: str) -> dict:
    """A field bounded by one of the server's --max-* limits: the document gives it `keyword`
    (maximum, maxItems) as the server runs (server/limits.py's Limits.`name`)."""
    return {"x-limit": [keyword, name]}


def not_null(*names: str) -> dict:
    return {"required": list(names), "properties": {n: {"not": {"type": "null"}} for n in names}}


def _given(name: str, schema: dict) -> dict:
    return {"required": [name], "properties": {name: schema}}


# response_format and structured_outputs as server/structured.py reads them.
RESPONSE_FORMAT_SCHEMA = {"anyOf": [{"type": "null"}, {
    "type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema", None]}},
    "if": _given("type", {"const": "json_schema"}),
    "then": _given("json_schema", {"type": "object", "properties": {"schema": {"type": ["object", "boolean"]}}})}]}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "whitespace_pattern",
                    "disable_any_whitespace", "disable_additional_properties")
STRUCTURED_OUTPUTS_SCHEMA = {"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": False,
    "properties": {k: {"type": ["string", "null"]} if k in ("regex", "grammar") else {} for k in _STRUCTURED_KEYS}}]}

# The fields that ask for an output constraint, each as it does: response_format of a JSON type,
# structured_outputs with a constraint in it (json_object only when truthy), a guided_* field.
_JSON_TYPES = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
_ASKS = {"response_format": _given("response_format", _JSON_TYPES),
         "structured_outputs": _given("structured_outputs", {"anyOf": [
             *(not_null(k) for k in ("json", "regex", "choice", "grammar")),
             _given("json_object", {"not": {"enum": [False, None, 0, "", [], {}]}})]}),
         **{name: not_null(name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}}
# One output constraint at most.
ONE_CONSTRAINT = {"not": {"anyOf": [{"allOf": [_ASKS[a], _ASKS[b]]}
                                    for i, a in enumerate(_ASKS) for b in list(_ASKS)[i + 1:]]}}


def no_constraint_with_tools(asks: dict, tools: dict, no_call: dict) -> dict:
    """An output constraint (`asks`) cannot come with tools a call may be made to (`tools`, unless
    tool_choice is as `no_call` says)."""
    return {"not": {"allOf": [asks, tools, {"not": no_call}]}}


# A chat tool is a named function; tool_choice is none, auto, required or a named function, and
# the last two need tools. (That the named one is among them no JSON schema can say: a 400.)
TOOL_SCHEMA = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": ["string", "null"]}, "parameters": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}}}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}]}


def needs_tools(choices: dict, tools: dict | None = None) -> dict:
    """JSON Schema's if/then: a tool_choice matching `choices` needs `tools` (by default, at least one)."""
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": choices}},
            "then": {"required": ["tools"], "properties": {"tools": tools or {"type": "array", "minItems": 1}}}}


def chat_rules() -> dict:
    """A chat request's: one constraint, tool_choice's tools, no constraint beside tools, and
    top_logprobs only with logprobs."""
    some_tools = _given("tools", {"type": "array", "minItems": 1})
    return {"allOf": [ONE_CONSTRAINT, needs_tools({"anyOf": [{"const": "required"}, {"type": "object"}]}),
                      no_constraint_with_tools({"anyOf": list(_ASKS.values())}, some_tools,
                                               _given("tool_choice", {"const": "none"})),
                      {"if": not_null("top_logprobs"), "then": _given("logprobs", {"const": True})}]}


def _eviction_schema() -> dict:
    """cache_eviction as the document states it: CacheEvictionConfig's fields and `enabled`; on a
    server without eviction, nothing that asks for any. (That max_cache_size is at least
    start_size + recent_size no JSON schema can say: a 400.)"""
    count, window, share = ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 1},
                            {"type": "number", "minimum": 0, "maximum": 1})
    fields = {"enabled": {"type": "boolean"}, "start_size": count, "recent_size": count, "max_cache_size": count,
              "aggregation": {"enum": list(AGGREGATIONS)}, "policy": {"enum": list(POLICIES)},
              "snapkv_window": window, "pool_window": window, "diversity": share, "layer_mix": share,
              **{name: {"type": "boolean"} for name in ("rotation", "protect_window", "during_prefill")}}
    return {"anyOf": [{"type": "null"}, {"type": "object", "properties": fields, "additionalProperties": False}],
            WITHOUT_EVICTION: {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]}}


CACHE_EVICTION_SCHEMA = _eviction_schema()
