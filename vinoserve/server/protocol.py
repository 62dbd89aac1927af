"""OpenAI request and response shapes (plus vLLM's extra sampling fields and /tokenize)."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationInfo, WithJsonSchema,
                      field_validator)

from vinoserve.scheduler.sampling_params import MAX_LOGPROBS
from vinoserve.server.limits import MAX_N
from vinoserve.server.request_rules import (CACHE_EVICTION_SCHEMA, ONE_CONSTRAINT, RESPONSE_FORMAT_SCHEMA,
                                            STRUCTURED_OUTPUTS_SCHEMA, TOOL_CHOICE_SCHEMA, TOOL_SCHEMA, chat_rules,
                                            WITHOUT_FIM, WITHOUT_IMAGES, limit)


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI does; clients send extras freely. Strict: a JSON
    # `true` is not a token id and "5" is not a count; what the schema says is what is accepted.
    model_config = ConfigDict(extra="ignore", strict=True)


def unsupported(why: str, kind: object = None):
    """A field this server refuses whenever it is given (only null, or `kind`'s values, is
    accepted), saying why rather than pydantic's "Input should be None"."""
    def check(value: object) -> object:
        if value is not None and value is not False:
            raise ValueError(why)
        return value
    return Annotated[kind, BeforeValidator(check)]


def unsupported_list(why: str):
    """A list field this server cannot honour: null and [] (which change nothing) are accepted."""
    def check(value: object) -> object:
        if value:
            raise ValueError(why)
        return value
    return Annotated[Annotated[list, Field(max_length=0)] | None, BeforeValidator(check)]


class StreamOptions(_Request):
    include_usage: bool = False


def _whole(value: object) -> object:
    """JSON Schema's integer includes 5.0; strict validation alone would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]


def bounded_int(**bounds: int):
    """An Int within bounds (ge=, le=) that the OpenAPI document states as minimum/maximum: a
    Field placed after the validator, inside `| None`, would come out as a bare "ge"."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]
TokenId = bounded_int(ge=0)
# An id the server checks against the vocabulary: the OpenAPI document states that bound (openapi.py).
VocabTokenId = Annotated[Int, Field(ge=0), WithJsonSchema({"type": "integer", "minimum": 0, "x-token-id": True})]
TokenIds = Annotated[list[VocabTokenId], Field(min_length=1, json_schema_extra=limit("maxItems", "max_prompt_tokens"))]
NonEmptyText = Annotated[str, Field(min_length=1)]


class _Sampling(_Request):
    model_config = ConfigDict(json_schema_extra=ONE_CONSTRAINT)
    model: str | None = None
    max_tokens: bounded_int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Int = Field(1, ge=1, json_schema_extra=limit("maximum", "max_n"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra=limit("maxItems", "max_stop_strings"))
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Int | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: bounded_int(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[VocabTokenId] | None = None
    # vLLM's, which would change the output: refused rather than ignored
    allowed_token_ids: unsupported_list("allowed_token_ids is not supported; logit_bias or guided_choice "
                                        "steer the output instead") = None
    bad_words: unsupported_list("bad_words is not supported; logit_bias with -100 bans tokens instead") = None
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: bool = True  # false: special tokens the model writes are part of the text
    prompt_logprobs: bounded_int(ge=0, le=MAX_LOGPROBS) | None = None
    # token ids, as OpenAI's map (the document's pattern takes only ids below the vocabulary: openapi.py)
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema({"anyOf": [{"type": "null"}, {
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$", "x-token-id-key": True},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]})] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: Annotated[dict | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    structured_outputs: Annotated[dict | None, WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)] = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vinoserve's extension: override the server's --cache-eviction settings for this request,
    # e.g. {"max_cache_size": 256} or {"enabled": false}
    cache_eviction: Annotated[dict | None, WithJsonSchema(CACHE_EVICTION_SCHEMA)] = None


class CompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={**ONE_CONSTRAINT, "if": {
        "required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},  # scoring the prompt only
        "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}})
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    logprobs: bounded_int(ge=0, le=MAX_LOGPROBS) | None = Field(  # top-k alternatives per token
        None, json_schema_extra=limit("maximum", "max_logprobs"))
    echo: bool = False
    max_tokens: bounded_int(ge=0) | None = None  # 0 with echo: score the prompt only
    best_of: bounded_int(ge=0, le=MAX_N) | None = None  # generate this many per prompt, return the n most likely
    suffix: str | None = Field(None, json_schema_extra={WITHOUT_FIM: {"anyOf": [{"type": "null"}, {"const": ""}]}})


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str  # a data: URL, or an http(s) one the server may fetch (--allowed-media-domains)
    # Each vision family sees an image at its processor's resolution: "low" would ask for less.
    detail: Literal["auto", "high"] | None = None


class ImagePart(_Request):
    # The OpenAPI document leaves it out for a model that takes no images (server/openapi.py).
    model_config = ConfigDict(json_schema_extra={WITHOUT_IMAGES: {"not": {}}})
    type: Literal["image_url"]
    image_url: ImageURL


def _part_kind(part: object) -> str:
    return "image-part" if isinstance(part, dict) and part.get("type") == "image_url" else "text-part"


# Tags with a hyphen stay out of an error's param (errors.invalid): messages.0.content.0.image_url.
ContentPart = Annotated[Annotated[TextPart, Tag("text-part")] | Annotated[ImagePart, Tag("image-part")],
                        Discriminator(_part_kind)]


class ChatMessage(_Request):
    # A tool result must say which call it answers, and what it says.
    model_config = ConfigDict(json_schema_extra={"if": {"properties": {"role": {"const": "tool"}}},
                                                 "then": {"required": ["content", "tool_call_id"],
                                                          "properties": {"content": {"not": {"type": "null"}},
                                                                         "tool_call_id": {"type": "string"}}}})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    reasoning_content: str | None = None  # an earlier turn's reasoning, for templates that render it (Qwen3)

    @field_validator("content", "tool_call_id")
    @classmethod
    def _tool_result(cls, value, info: ValidationInfo):
        if value is None and info.data.get("role") == "tool":
            raise ValueError(f"a tool message needs {info.field_name}")
        return value


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra=chat_rules())
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: bounded_int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: bounded_int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, json_schema_extra=limit("maximum", "max_logprobs"))
    add_generation_prompt: bool = True
    tools: Annotated[list[dict] | None, WithJsonSchema({"anyOf": [{"type": "array", "items": TOOL_SCHEMA},
                                                                  {"type": "null"}]})] = None
    tool_choice: Annotated[str | dict | None, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict | None = None


class TokenizeRequest(_Request):
    # Exactly one of prompt and messages; neither may be null.
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    prompt: str = None  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[VocabTokenId]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody

