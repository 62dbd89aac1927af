"""A chat request, prepared: from messages, tools, tool_choice, response_format (or vLLM's
structured outputs), sampling fields and chat_template_kwargs to the prompt's token ids, its
compiled grammar, SamplingParams, the tool plan and the per-choice text parsers.

Every chat-shaped API goes through `prepare_chat`: /v1/chat/completions directly; the Responses and
Anthropic Messages modules convert their input into a ChatCompletionRequest (`chat_request`) and
call the same path, so tools, reasoning and constraints behave the same on all of them:

    req = chat_request({"messages": [...], "tools": [...], "tool_choice": "auto",
                        "max_completion_tokens": body.max_output_tokens, "stream": body.stream})
    prepared = await prepare_chat(serving, req)
    streams = serving.admit([prepared.prompt], prepared.params, "messages", None, req.n, prepared.images)
    async for item in serving.events([prepared.prompt], streams, prepared.choice_text): ...
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from pydantic import ValidationError

from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.scheduler.media import ImageSpan
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.chat_render import render_prompt
from vinoserve.server.echo import PromptScoring, prompt_scoring
from vinoserve.server.errors import APIError, invalid
from vinoserve.server.event_stream import ChoiceText, ParsedText, PlainText
from vinoserve.server.images import ImageRef, image_prompt, take_images
from vinoserve.server.protocol import ChatCompletionRequest
from vinoserve.server.reasoning import ReasoningFormat, Start
from vinoserve.server.serving import ChatSetup, Serving
from vinoserve.server.structured import compile_grammar, requested_grammar
from vinoserve.server.vision_pacing import Pacing
from vinoserve.server.tools import ToolFormat, ToolPlan, tool_plan

# Template variables the server sets itself; chat_template_kwargs may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "chat_template"})


@dataclass(frozen=True)
class PreparedChat:
    prompt: list[int]
    params: SamplingParams
    scoring: PromptScoring  # prompt_logprobs, if asked
    tools: ToolPlan | None  # None: no call may be made
    tool_format: ToolFormat
    reasoning: ReasoningFormat | None
    reasoning_start: Start | None  # where the prompt leaves the reasoning
    images: tuple[ImageSpan, ...] = ()  # rows of the prompt's images, at their positions

    def choice_text(self) -> ChoiceText:
        """A fresh reader of one choice's text: reasoning split off, tool calls parsed."""
        if self.tools is None and self.reasoning is None:
            return PlainText()
        return ParsedText(self.reasoning.parser(self.reasoning_start) if self.reasoning else None,
                          self.tool_format.parser(self.tools) if self.tools else None,
                          self.tools is not None and self.tools.forced)


def chat_request(fields: dict) -> ChatCompletionRequest:
    """A ChatCompletionRequest built from another API's converted fields; 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise invalid(e.errors()) from e


async def prepare_chat(serving: Serving, req: ChatCompletionRequest) -> PreparedChat:
    """Validates everything that can be known before the request queues (400s), renders and
    tokenizes the prompt, compiles the constraint."""
    serving.limits.check_request(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
    tools = tool_plan(req)
    setup = serving.chat
    text, prompt, images = await chat_prompt(serving, req, tools)
    serving.limits.check_prompts([prompt], "messages")
    start = setup.reasoning.start_state(text) if setup.reasoning else None
    found = requested_grammar(req)
    if tools is not None:
        if found is not None:
            raise APIError(400, f"{found[1]} cannot be combined with tools (unless tool_choice is none)", found[1])
        for f in tools.strict:  # held to the whole schema: what llguidance cannot enforce is a 400
            schema = GrammarSpec.json_schema(f.get("parameters") or {"type": "object"})
            await compile_grammar(serving.engine.grammars, schema, "tools", f"tools ({f['name']} is strict)")
        spec = setup.tool_format.grammar(tools)
        found = (spec, "tools") if spec is not None else None
    grammar = None
    if found is not None:
        grammar = setup.reasoning.constrain(found[0], start, tools=found[1] == "tools") if setup.reasoning \
            else found[0]
        await compile_grammar(serving.engine.grammars, grammar, found[1])
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    scoring = prompt_scoring(req, False, max_tokens)
    params = serving.sampling_params(req, max_tokens, len(prompt), (req.top_logprobs or 0) if req.logprobs else None,
                                     grammar, scoring.engine_k)
    if (tools is not None and not setup.tool_format.skip_special_tokens) or \
            (setup.reasoning is not None and not setup.reasoning.skip_special_tokens):
        params = replace(params, skip_special_tokens=False)
    return PreparedChat(prompt, params, scoring, tools, setup.tool_format, setup.reasoning, start, images)


async def chat_prompt(serving: Serving, req: ChatCompletionRequest, tools: ToolPlan | None = None,
                      encode_images: bool = True) -> tuple[str, list[int], tuple[ImageSpan, ...]]:
    """The rendered prompt, its token ids, and its images' rows where it holds any (without
    `encode_images`, only their tokens are counted: nothing is encoded)."""
    vision = serving.engine.vision
    text, refs = await asyncio.to_thread(chat_prompt_text, serving.chat, serving.tokenizer, req, tools,
                                         vision is not None)  # big prompts take ms
    if not refs:
        return text, serving.tokenizer.encode(text, add_special_tokens=False), ()
    pacing = Pacing(lambda: serving.engine.stats.num_running > 0, serving.vision_share)
    built = await image_prompt(text, refs, vision, serving.tokenizer, serving.media, encode_images, pacing)
    return text, built.ids, built.images


def chat_prompt_text(setup: ChatSetup, tokenizer, req: ChatCompletionRequest, tools: ToolPlan | None = None,
                     images: bool = False) -> tuple[str, list[ImageRef]]:
    """The conversation rendered by the chat template, tools declared the tool format's way, each
    image part a marker in its message's text (`images`: the model takes them; else a 400)."""
    kwargs = req.chat_template_kwargs or {}
    if clash := sorted(_RESERVED & kwargs.keys()):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    refs = take_images(messages, images)
    if not setup.template:
        raise APIError(400, "this model has no chat template (--chat-template gives one)", "messages")
    messages, extra = setup.tool_format.render(messages, tools, setup.template)

    def render(kw: dict) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             chat_template=setup.template, **extra, **kw)
    return render_prompt(render, kwargs, setup.template_name), refs
