"""The shapes a POST /v1/responses body may take, as pydantic models: what they accept is what
the OpenAPI document states (openai's own types name them). Items and parts a model with
function tools cannot honour (files, built-in tools' calls, item references) and tools
the client would run other than functions (custom, shell, computer use) are not among them, so
they are a 400 naming the field."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from vinoserve.server.protocol import _Request, unsupported
from vinoserve.server.request_rules import WITHOUT_REASONING


class TextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: str


class InputTextPart(_Request):
    type: Literal["input_text"]
    text: str


class InputImagePart(_Request):
    type: Literal["input_image"]
    image_url: str  # a data: URL, or an http(s) one the server may fetch (--allowed-media-domains)
    file_id: unsupported("file_id: this server stores no files; send the image as image_url") = None
    # Each vision family sees an image at its processor's resolution: "low" would ask for less.
    detail: Literal["auto", "high"] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | RefusalPart | InputImagePart, Field(discriminator="type")]]
    id: str | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a function of a namespace tool (server/responses/tools.py)
    id: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Request):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # another server's sealed reasoning: nothing this one can read
    id: str | None = None


def _item_kind(item: object) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamespaceTool(_Request):
    """A group of functions under one name; the model is offered them flattened (responses/tools.py)."""
    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    tools: Annotated[list[FunctionTool], Field(min_length=1)]


# Tools OpenAI runs on its own servers. Accepted and not offered to the model: see responses/tools.py.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "mcp")


class HostedTool(_Request):
    model_config = ConfigDict(extra="allow", strict=True)  # its settings are echoed back as sent
    type: Literal[HOSTED_TOOLS]


Tool = Annotated[FunctionTool | NamespaceTool | HostedTool, Field(discriminator="type")]


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class ToolChoiceAllowed(_Request):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict]


ToolChoice = Literal["auto", "none", "required"] | Annotated[ToolChoiceFunction | ToolChoiceAllowed,
                                                              Field(discriminator="type")]


class FormatText(_Request):
    type: Literal["text"]


class FormatJsonObject(_Request):
    type: Literal["json_object"]


class FormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # low and high would change the reply; nothing here can


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, json_schema_extra={WITHOUT_REASONING: {"enum": ["none", None]}})
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# `include` values; message.output_text.logprobs is not among them (no logprobs here).
Includable = Literal["reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                     "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]  # OpenAI's limits
