"""A POST /v1/responses body: validated here, then converted into a chat request's fields.

Honoured: input (string or items), instructions, function and namespace tools (responses/tools.py),
tool_choice (auto, none, required, a function, allowed_tools), parallel_tool_calls, text.format
(text, json_object, json_schema), max_output_tokens, temperature, top_p (and vLLM's sampling
extras), reasoning.effort on a reasoning model (none turns thinking off), metadata, store,
previous_response_id, stream. Built-in tools OpenAI runs itself (web_search, ...) are accepted
and not offered to the model, with a warning (responses/tools.py). Refused with a 400, because
they would change the result and this server cannot honour them: other tool types, background,
conversation, prompt templates, logprobs, truncation "auto", text.verbosity other than medium,
reasoning on a model that does not reason. Fields that change nothing here (user, service_tier,
prompt_cache_key, client_metadata, include of reasoning.encrypted_content, reasoning.summary)
are accepted, as OpenAI ignores unknown fields.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field

from vinoserve.server.errors import APIError
from vinoserve.server.protocol import Int, _Request, bounded_int, unsupported
from vinoserve.server.request_rules import needs_tools, no_constraint_with_tools
from vinoserve.server.responses.schema import (Includable, Item, Metadata, ReasoningConfig, TextConfig, Tool,
                                               ToolChoice, ToolChoiceAllowed, ToolChoiceFunction)
from vinoserve.server.responses.tools import OfferedTools, flat_name


def _no_auto_truncation(value: object) -> object:
    if value == "auto":
        raise ValueError("truncation 'auto' is not supported: an input over the context is refused either way")
    return value


def _no_logprobs(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        raise ValueError("logprobs are not supported on /v1/responses; use /v1/chat/completions")
    return value


_OFFERED = {"type": "array", "contains": {"required": ["type"], "properties": {"type": {"enum": ["function",
                                                                                              "namespace"]}}}}
_RULES = {"allOf": [
    # required (or allowed_tools' required) or a named function needs a function tool (built-in tools
    # are not offered: tools.py); that the named ones are among them no JSON schema can say (a 400).
    needs_tools({"anyOf": [{"const": "required"}, {"required": ["type"], "properties": {"type": {"const": "function"}}},
                           {"required": ["mode"], "properties": {"mode": {"const": "required"}}}]}, _OFFERED),
    # text.format of JSON cannot come with tools a call may be made to (allowed_tools may leave none)
    no_constraint_with_tools(
        {"required": ["text"], "properties": {"text": {"required": ["format"], "properties": {"format": {
            "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}}},
        {"required": ["tools"], "properties": {"tools": _OFFERED}},
        {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [
            {"const": "none"}, {"type": "object", "required": ["type"],
                                "properties": {"type": {"const": "allowed_tools"}}}]}}}),
    # something to answer: a message or a call's output, instructions, or an earlier response
    {"anyOf": [{"properties": {"input": {"type": "string"}}},
               {"properties": {"input": {"contains": {"not": {"required": ["type"],
                                                              "properties": {"type": {"const": "reasoning"}}}}}}},
               {"required": ["instructions"], "properties": {"instructions": {"type": "string", "minLength": 1}}},
               {"required": ["previous_response_id"],
                "properties": {"previous_response_id": {"type": "string", "minLength": 1}}}]}]}


class ResponsesRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_RULES)
    model: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: bounded_int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: Metadata | None = None
    store: bool = True
    # Accepted, and change nothing here: the prefix cache needs no key; client_metadata is Codex's
    # per-turn telemetry, which OpenAI keeps in its logs.
    prompt_cache_key: str | None = None
    client_metadata: dict[str, str] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    truncation: Annotated[Literal["disabled"] | None, BeforeValidator(_no_auto_truncation)] = None
    include: list[Includable] | None = None
    top_logprobs: Annotated[bounded_int(ge=0, le=0) | None, BeforeValidator(_no_logprobs)] = None
    background: unsupported("background responses are not supported", Literal[False] | None) = None
    conversation: unsupported("conversations are not supported; use previous_response_id") = None
    prompt: unsupported("prompt templates are not supported") = None
    context_management: unsupported("context management is not supported") = None
    # vLLM's sampling extras, as its Responses endpoint takes them
    top_k: bounded_int(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    def items(self) -> list[dict]:
        """The input as items (a string is one user message), as plain dicts."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [i.model_dump(exclude_none=True, by_alias=True) for i in self.input]


def chat_fields(body: ResponsesRequest, messages: list[dict], reasons: bool, offered: OfferedTools) -> dict:
    """The ChatCompletionRequest fields of a Responses request, its conversation given as chat
    messages (any earlier response's, then the input's), its tools as `offered`."""
    if not reasons and body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        raise APIError(400, "this model does not reason", "reasoning.effort")
    fields = {"messages": messages, "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
              "max_completion_tokens": body.max_output_tokens, "response_format": response_format(body.text),
              **body.model_dump(include={"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                                         "presence_penalty", "frequency_penalty"}, exclude_none=True)}
    choice, tools = chat_tool_choice(body.tool_choice, offered.chat)
    if not tools and offered.not_offered and choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice needs a function tool: built-in tools ({', '.join(offered.not_offered)}) "
                            "are not offered to the model here", "tool_choice")
    if tools:
        fields["tools"] = tools
    if choice is not None:
        fields["tool_choice"] = choice
    if reasons and body.reasoning is not None and body.reasoning.effort is not None:
        # Qwen3-style templates read enable_thinking; gpt-oss-style ones read reasoning_effort.
        effort = body.reasoning.effort
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    return fields


def chat_tool_choice(choice: ToolChoice | None, tools: list[dict]) -> tuple[str | dict | None, list[dict]]:
    """Responses' tool_choice as chat's, and the tools it leaves on offer."""
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}, tools
    if isinstance(choice, ToolChoiceAllowed):
        names = {flat_name(t.get("namespace"), t["name"]) for t in choice.tools
                 if t.get("type") == "function" and isinstance(t.get("name"), str)}
        return choice.mode, [t for t in tools if t["function"]["name"] in names]
    return choice, tools


def response_format(text: TextConfig | None) -> dict | None:
    """text.format as chat's response_format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}
