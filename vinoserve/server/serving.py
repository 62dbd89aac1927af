"""What every API module shares once the model is loaded: the engine, the served name, sampling
defaults, limits, the chat setup (template, tool-call format, reasoning format), and the steps
from a validated request to running engine streams: sampling params, admission, events.

Route modules get it with `Depends(current)`; it raises the 503 that says the model is not ready.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request

from vinoserve.engine.async_engine import AsyncLLMEngine, RequestStream
from vinoserve.model.generation_config import GenerationDefaults
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.scheduler.media import ImageSpan
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.errors import APIError, bad_value
from vinoserve.server.event_stream import ChoiceText, PlainText, event_stream
from vinoserve.server.events import Step, Usage
from vinoserve.server.limits import MAX_N, Limits, over_capacity
from vinoserve.server.media import MediaPolicy
from vinoserve.server.metrics import Metrics
from vinoserve.server.protocol import new_id
from vinoserve.server.registry import ModelRegistry
from vinoserve.server.reasoning import ReasoningFormat, select_reasoning
from vinoserve.server.tools import ToolFormat, select_tool_format

@dataclass(frozen=True)
class ChatSetup:
    """How chat requests become prompts and replies for this model, fixed at startup."""

    template: str  # --chat-template's text, else the model's own ("" when it has none)
    tool_format: ToolFormat
    reasoning: ReasoningFormat | None
    template_name: str = "the model's chat template"  # what an error in rendering it calls it

    @classmethod
    def build(cls, tokenizer: Tokenizer, chat_template: str | None = None, tool_call_parser: str = "auto",
              reasoning_parser: str = "auto") -> ChatSetup:
        template = chat_template if chat_template is not None else tokenizer.chat_template or ""
        # A tool format's tags may be single special tokens ([TOOL_CALLS]): its grammar names them by id.
        special = {tokenizer.token_bytes[i].decode("utf-8", "replace"): i
                   for i in sorted(tokenizer.special_token_ids) if i < len(tokenizer.token_bytes)}
        return cls(template, select_tool_format(tool_call_parser, template, special),
                   select_reasoning(reasoning_parser, template, special),
                   "the chat template of --chat-template" if chat_template is not None else cls.template_name)

    def describe(self) -> str:
        reasoning = self.reasoning.name if self.reasoning else "none"
        return f"tool calls in the {self.tool_format.name} format; reasoning parser {reasoning}"


class Serving:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: Metrics, max_queue: int | None,
                 generation_defaults: GenerationDefaults, limits: Limits, chat: ChatSetup,
                 media: MediaPolicy | None = None, vision_share: float = 1.0) -> None:
        self.engine, self.model_name, self.metrics, self.max_queue = engine, model_name, metrics, max_queue
        self.generation_defaults, self.limits, self.chat = generation_defaults, limits, chat
        self.media = media or MediaPolicy()
        self.vision_share = vision_share  # of the time the vision tower computes while requests decode
        self.registry: ModelRegistry | None = None  # the other models served beside this one

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            if self.registry is not None and model in self.registry.encoders:
                self.registry.pick(model, "chat", "this endpoint")  # the 400 naming what it serves
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def sampling_params(self, req, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                        grammar: GrammarSpec | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """From a request's sampling fields (OpenAI's and vLLM's names), the model's defaults for
        those it leaves out, and OpenAI's for the rest."""
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n")
        best_of = num_choices(req)
        if best_of < req.n or best_of > MAX_N:
            raise APIError(400, f"best_of must be in [n, {MAX_N}], got {best_of}", "best_of")
        if best_of > req.n:
            if req.stream:
                raise APIError(400, "best_of > n cannot be streamed", "best_of")
            logprobs = 0 if logprobs is None else logprobs  # choices are ranked by their logprob
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        base, model = SamplingParams(), self.generation_defaults
        # What the context leaves; a prompt longer than the context (evicting with rotation during
        # prefill, else refused) gets a context's worth.
        remaining = self.engine.max_context - prompt_len if prompt_len < self.engine.max_context \
            else self.engine.max_context
        bias = req.logit_bias or {}
        if any(not (t.isascii() and t.isdigit()) for t in bias):  # int() would take "+5", " 5", "5_0"
            raise APIError(400, "logit_bias keys must be token ids, written in decimal digits", "logit_bias")
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(model.max_tokens or remaining, remaining),
                temperature=_first(req.temperature, model.temperature, base.temperature),
                top_p=_first(req.top_p, model.top_p, base.top_p),
                top_k=_first(req.top_k, model.top_k, base.top_k),
                min_p=_first(req.min_p, model.min_p, base.min_p),
                repetition_penalty=_first(req.repetition_penalty, model.repetition_penalty, base.repetition_penalty),
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                logit_bias=tuple((int(t), b) for t, b in bias.items()), grammar=grammar,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            )
            params.check_vocabulary(self.engine.vocab_size, self.engine.eos_token_ids)
            return params
        except ValueError as e:
            raise bad_value(e) from e

    def admit(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
              cache_eviction: dict | None = None, n: int = 1,
              images: tuple[ImageSpan, ...] = ()) -> list[RequestStream]:
        """Validate, apply --max-queue, and submit: all before the handler next awaits, so
        concurrent requests cannot all slip under the limit. n choices per prompt, in order;
        `images` belong to a lone prompt (a chat's)."""
        assert not images or len(prompts) == 1
        for ids in prompts:
            try:
                self.engine.prepare(ids, params, cache_eviction, images)
            except ValueError as e:
                raise bad_value(e, "cache_eviction" if str(e).startswith("cache_eviction") else prompt_param) from e
        if self.max_queue is not None and self.engine.num_waiting + len(prompts) * n > self.max_queue:
            raise over_capacity(self.max_queue)
        if n == 1:
            return [self.engine.submit(ids, params, cache_eviction=cache_eviction, images=images) for ids in prompts]
        return [stream for ids in prompts for stream in self._choices(ids, params, cache_eviction, n, images)]

    def _choices(self, ids: list[int], params: SamplingParams, cache_eviction: dict | None,
                 n: int, images: tuple[ImageSpan, ...]) -> list[RequestStream]:
        """n choices of one prompt: the first computes the prompt, the others fork from it (its
        KV, its logits) and sample on their own; a seed gives each choice seed + index."""
        group = new_id("req")
        return [self.engine.submit(ids, params.choice(i), f"{group}-{i}", cache_eviction,
                                   fork_of=f"{group}-0" if i else None, images=images)
                for i in range(n)]

    def events(self, prompts: list[list[int]], streams: list[RequestStream],
               choice_text: Callable[[], ChoiceText] = PlainText) -> AsyncIterator[Step | Usage]:
        """The admitted streams as protocol-neutral events (server/event_stream.py)."""
        return event_stream(self.tokenizer, self.metrics, prompts, streams, choice_text)


def current(request: Request) -> Serving:
    """FastAPI dependency: the loaded model's Serving, or the 503 saying why there is none."""
    return request.app.state.vinoserve.ready()


def num_choices(req) -> int:
    """Choices generated per prompt: best_of (completions only) or n."""
    return getattr(req, "best_of", None) or req.n


def _first(*values):
    """The request's value, else the model's default, else OpenAI's."""
    return next(v for v in values if v is not None)
