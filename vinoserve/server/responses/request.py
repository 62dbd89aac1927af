"""A POST /v1/responses body: validated here, then converted into a chat request's fields.

Honoured: input (string or items), instructions, function tools (Responses' flat shape),
tool_choice (auto, none, required, a function, allowed_tools), parallel_tool_calls, text.format
(text, json_object, json_schema), max_output_tokens, temperature, top_p (and vLLM's sampling
extras), reasoning.effort on a reasoning model (none turns thinking off), metadata, store,
previous_response_id, stream. Refused with a 400, because they would change the result and this
server cannot honour them: built-in tools, background, conversation, prompt templates, logprobs,
truncation "auto", text.verbosity other than medium, reasoning on a model that does not reason.
Fields that change nothing here (user, service_tier, prompt_cache_key, include of
reasoning.encrypted_content, ...) are accepted, as OpenAI ignores unknown fields.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vinoserve.server.errors import APIError
from vinoserve.server.protocol import Int, _Request

_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


class TextConfig(_Request):
    format: dict | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list
    instructions: str | None = None
    tools: list[dict] = []
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    context_management: list | dict | None = None
    # vLLM's sampling extras, as its Responses endpoint takes them
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters and values up to 512")
        return value


def refuse_unsupported(body: ResponsesRequest, reasons: bool) -> None:
    """400 for fields that would change the result but cannot be honoured here. `reasons`:
    whether the model reasons (the server has a reasoning parser)."""
    refused = [("background", body.background, "background responses are not supported"),
               ("conversation", body.conversation is not None, "conversations are not supported; use "
                                                                "previous_response_id"),
               ("prompt", body.prompt is not None, "prompt templates are not supported"),
               ("context_management", body.context_management is not None, "context management is not supported"),
               ("truncation", body.truncation == "auto", "truncation 'auto' is not supported: an input over the "
                                                         "context is refused either way"),
               ("top_logprobs", bool(body.top_logprobs), "logprobs are not supported on /v1/responses; use "
                                                        "/v1/chat/completions"),
               ("include", "message.output_text.logprobs" in (body.include or []),
                "logprobs are not supported on /v1/responses; use /v1/chat/completions"),
               ("text.verbosity", body.text is not None and body.text.verbosity not in (None, "medium"),
                "text.verbosity is not supported by this model"),
               ("reasoning.effort", not reasons and body.reasoning is not None
                and body.reasoning.effort not in (None, "none"), "this model does not reason")]
    for param, hit, message in refused:
        if hit:
            raise APIError(400, message, param)


def chat_fields(body: ResponsesRequest, messages: list[dict], reasons: bool) -> dict:
    """The ChatCompletionRequest fields of a Responses request, its conversation given as chat
    messages (any earlier response's, then the input's)."""
    refuse_unsupported(body, reasons)
    fields = {"messages": messages, "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
              "max_completion_tokens": body.max_output_tokens, "response_format": response_format(body.text),
              **body.model_dump(include={"temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                                         "presence_penalty", "frequency_penalty"}, exclude_none=True)}
    tools = chat_tools(body.tools)
    choice, tools = chat_tool_choice(body.tool_choice, tools)
    if tools:
        fields["tools"] = tools
    if choice is not None:
        fields["tool_choice"] = choice
    if reasons and body.reasoning is not None and body.reasoning.effort is not None:
        # Qwen3-style templates read enable_thinking; gpt-oss-style ones read reasoning_effort.
        effort = body.reasoning.effort
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    return fields


def chat_tools(tools: list[dict]) -> list[dict]:
    """Responses' flat function tools as chat tools; any other tool type is refused."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported; this server runs function "
                                "tools only", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}].name must be a string", f"tools[{i}].name")
        out.append({"type": "function", "function": {k: tool[k] for k in _FUNCTION_KEYS if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict | None, tools: list[dict]) -> tuple[str | dict | None, list[dict]]:
    """Responses' tool_choice as chat's, and the tools it leaves on offer."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, tools
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        names = {t.get("name") for t in choice.get("tools") or []
                 if isinstance(t, dict) and t.get("type") == "function"}
        return choice["mode"], [t for t in tools if t["function"]["name"] in names]
    raise APIError(400, "tool_choice must be none, auto, required, {\"type\": \"function\", \"name\": ...} or "
                        f"allowed_tools over function tools; got {choice!r}", "tool_choice")


def response_format(text: TextConfig | None) -> dict | None:
    """text.format as chat's response_format."""
    fmt = text.format if text is not None else None
    kind = fmt.get("type") if fmt is not None else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict) and isinstance(fmt.get("name"), str):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise APIError(400, "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format")
