"""/v1/completions and /v1/chat/completions: requests -> engine streams -> OpenAI responses."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vinoserve.engine.async_engine import AsyncLLMEngine, RequestStream
from vinoserve.engine.outputs import RequestOutput
from vinoserve.model.generation_config import GenerationDefaults
from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.echo import PromptScoring, echo_entries, vllm_prompt_logprobs
from vinoserve.server.errors import APIError, bad_value, error_body, failure
from vinoserve.server.limits import over_capacity
from vinoserve.server.metrics import Metrics
from vinoserve.server.protocol import ChatCompletionRequest, new_id, now
from vinoserve.server.tools import ToolPlan, ToolReply, render_messages


@dataclass
class _Choice:
    """One prompt's generation, accumulated."""

    index: int
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list | None = None
    cached_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None  # the engine's per prompt token (logprob, top, rank)


MAX_N = 128  # OpenAI's limit on choices per request


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: Metrics, max_queue: int | None,
                 generation_defaults: GenerationDefaults = GenerationDefaults()) -> None:
        self.engine, self.model_name, self.metrics, self.max_queue = engine, model_name, metrics, max_queue
        self.generation_defaults = generation_defaults
        self.tokenizer = engine.engine.tokenizer

    # ---- request -> prompts and params
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if isinstance(m.get("content"), list):  # text parts only: this is a text model
                m["content"] = "".join(p.get("text") or "" for p in m["content"] if p.get("type") == "text")
        messages, extra = render_messages(messages, tools, self.tokenizer.chat_template or "")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      **extra)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def sampling_params(self, req, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                        grammar: GrammarSpec | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
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
        remaining = max(1, self.engine.engine.max_context - prompt_len)
        try:
            bias = tuple((int(t), b) for t, b in (req.logit_bias or {}).items())
        except ValueError as e:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from e
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(model.max_tokens or remaining, remaining),
                temperature=_first(req.temperature, model.temperature, base.temperature),
                top_p=_first(req.top_p, model.top_p, base.top_p),
                top_k=_first(req.top_k, model.top_k, base.top_k),
                min_p=_first(req.min_p, model.min_p, base.min_p),
                repetition_penalty=_first(req.repetition_penalty, model.repetition_penalty, base.repetition_penalty),
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                logit_bias=bias, grammar=grammar, prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise bad_value(e) from e

    def admit(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
              cache_eviction: dict | None = None, n: int = 1) -> list[RequestStream]:
        """Validate, apply --max-queue, and submit: all before the handler next awaits, so
        concurrent requests cannot all slip under the limit. n choices per prompt, in order."""
        for ids in prompts:
            try:
                self.engine.prepare(ids, params, cache_eviction)
            except ValueError as e:
                raise bad_value(e, "cache_eviction" if str(e).startswith("cache_eviction") else prompt_param) from e
        if self.max_queue is not None and self.engine.num_waiting + len(prompts) * n > self.max_queue:
            raise over_capacity(self.max_queue)
        if n == 1:
            return [self.engine.submit(ids, params, cache_eviction=cache_eviction) for ids in prompts]
        return [stream for ids in prompts for stream in self._choices(ids, params, cache_eviction, n)]

    def _choices(self, ids: list[int], params: SamplingParams, cache_eviction: dict | None,
                 n: int) -> list[RequestStream]:
        """n choices of one prompt: the first computes the prompt, the others fork from it (its
        KV, its logits) and sample on their own; a seed gives each choice seed + index."""
        group = new_id("req")
        return [self.engine.submit(ids, params.choice(i),
                                   f"{group}-{i}", cache_eviction, fork_of=f"{group}-0" if i else None)
                for i in range(n)]

    # ---- engine streams
    async def _merged(self, prompts: list[list[int]], streams: list[RequestStream]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams (n per prompt) as they come, tagged with the stream's index, with
        per-token and per-request metrics. Leaving it early (a client gone, a cancelled task) waits
        for its pumps to stop and closes every stream, which aborts unfinished requests."""
        n = len(streams) // len(prompts)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            last = None
            try:
                async for out in stream:
                    t = time.monotonic()
                    if last is None and out.new_token_ids and i % n == 0:  # a prompt counts once, when computed
                        self.metrics.prefilled(len(prompts[i // n]), out.metrics)
                    for _ in out.new_token_ids:
                        self.metrics.token(None if last is None else t - last)
                        last = t
                    if out.finished and out.metrics:
                        self.metrics.finished(out.metrics)
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                left -= item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            # Closing a stream a pump is still awaiting would race it; let the pumps unwind first.
            await asyncio.gather(*tasks, return_exceptions=True)
            close_all(streams)

    # ---- responses
    async def respond(self, raw: Request, req, prompts: list[list[int]], streams, chat: bool,
                      tools: ToolPlan | None = None, scoring: PromptScoring = PromptScoring()):
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(rid, prompts, streams, chat, include_usage, req.n, tools, scoring)
            return _ClosingStreamingResponse(events, streams, media_type="text/event-stream")
        best_of = num_choices(req)
        # With best_of > n the logprobs were computed to rank the choices; shown only if asked for.
        shown = best_of == req.n or req.logprobs is not None
        return await _unless_disconnected(raw, self._complete(rid, prompts, streams, chat, best_of, req.n, shown, tools,
                                                                        scoring),
                                          streams)

    async def _complete(self, rid: str, prompts, streams, chat: bool, n: int = 1, keep: int | None = None,
                        keep_logprobs: bool = True, tools: ToolPlan | None = None,
                        scoring: PromptScoring = PromptScoring()) -> JSONResponse:
        """n choices per prompt came back; `keep` of them (the most likely first) are returned."""
        choices = [_Choice(i, prompt_ids=prompts[i // n]) for i in range(len(streams))]
        async for i, out in self._merged(prompts, streams):
            c = choices[i]
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if scoring.score_only:
                c.finish_reason = "length"
                continue
            c.text += out.new_text
            c.tokens = out.num_output_tokens
            c.finish_reason = out.finish_reason
            c.cached_tokens = out.num_cached_tokens
            if out.new_logprobs is not None:
                c.logprobs = (c.logprobs or []) + self._token_logprobs(out)
        usage = _usage(sum(map(len, prompts)), sum(c.tokens for c in choices),
                       sum(c.cached_tokens for c in choices[::n]))
        if keep is not None and keep < n:
            choices = _best_of(choices, n, keep, keep_logprobs)
        body = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": self.model_name,
            "choices": [self._final_choice(c, chat, tools) for c in choices],
            "usage": usage,
        }
        if scoring.echo:
            for c, choice in zip(choices, body["choices"]):
                self._echo(c, choice, scoring)
        if scoring.prompt_logprobs is not None:  # per choice for completions, once for chat, as vLLM does
            for c, choice in zip(choices, body["choices"]):
                (body if chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(
                    c.prompt_ids, c.prompt_logprobs or [], scoring.prompt_logprobs, self._token_entry)
        return JSONResponse(body)

    def _echo(self, c: _Choice, choice: dict, scoring: PromptScoring) -> None:
        """Completions' echo: the prompt's text, and its tokens' logprobs, before the output's."""
        choice["text"] = self.tokenizer.decode(c.prompt_ids, skip_special_tokens=False) + choice["text"]
        if scoring.echo_logprobs is not None:
            entries = echo_entries(c.prompt_ids, c.prompt_logprobs or [], self._token_entry)
            choice["logprobs"] = _legacy_logprobs(entries + (c.logprobs or []))

    def _final_choice(self, c: _Choice, chat: bool, tools: ToolPlan | None = None) -> dict:
        if chat:
            lp = {"content": c.logprobs} if c.logprobs is not None else None
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if tools is not None:
                reply = ToolReply(tools)
                reply.feed(c.text)
                message, reason = reply.message(reason)
            return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason}
        return {"index": c.index, "text": c.text, "logprobs": _legacy_logprobs(c.logprobs),
                "finish_reason": c.finish_reason}

    async def _sse(self, rid: str, prompts, streams, chat: bool, include_usage: bool,
                   n: int = 1, tools: ToolPlan | None = None, scoring: PromptScoring = PromptScoring()
                   ) -> AsyncIterator[str]:
        created, obj = now(), "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if chat:
            for i in range(len(streams)):
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        tokens, cached = [0] * len(streams), [0] * len(streams)
        try:
            replies = [ToolReply(tools) for _ in streams] if tools is not None else []
            echoed = [False] * len(streams)
            async for i, out in self._merged(prompts, streams):
                tokens[i], cached[i] = out.num_output_tokens, out.num_cached_tokens
                if tools is not None:
                    deltas = replies[i].feed(out.new_text) + (replies[i].finish() if out.finished else [])
                    for delta in deltas:
                        yield event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                    if out.finished:
                        _, reason = replies[i].message(out.finish_reason)
                        yield event([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
                    continue
                # One chunk per token, even one that completes no character yet: clients can
                # time every token (ITL), and the text stays whole-character.
                lp = self._token_logprobs(out) if out.new_logprobs is not None else None
                text, reason = out.new_text, out.finish_reason
                if scoring.score_only:
                    text, lp, reason, tokens[i] = "", None if lp is None else [], "length", 0
                if scoring.echo and not echoed[i]:  # the first output: the prompt is scored by now
                    echoed[i] = True
                    text = self.tokenizer.decode(prompts[i // n], skip_special_tokens=False) + text
                    if scoring.echo_logprobs is not None:
                        lp = echo_entries(prompts[i // n], out.prompt_logprobs or [], self._token_entry) + (lp or [])
                if chat:
                    delta = {"content": text} if text or not out.finished else {}
                    choice = {"index": i, "delta": delta, "logprobs": {"content": lp} if lp else None}
                else:
                    choice = {"index": i, "text": text, "logprobs": _legacy_logprobs(lp)}
                    if scoring.prompt_logprobs is not None and out.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompts[i // n], out.prompt_logprobs,
                                                                         scoring.prompt_logprobs, self._token_entry)
                choice["finish_reason"] = reason if out.finished else None
                yield event([choice])
        except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            status, message, code = failure(e)
            yield f"data: {json.dumps(error_body(status, message, code=code))}\n\n"
            return
        if include_usage:
            yield event([], _usage(sum(len(p) for p in prompts), sum(tokens), sum(cached[::n])))
        yield "data: [DONE]\n\n"

    def _token_logprobs(self, out: RequestOutput) -> list[dict]:
        entries = []
        for token, (logprob, top) in zip(out.new_token_ids, out.new_logprobs or []):
            entry = self._token_entry(token, logprob)
            entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in top]
            entries.append(entry)
        return entries

    def _token_entry(self, token: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes[token] if token < len(self.tokenizer.token_bytes) else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0),
                "bytes": list(raw)}


def num_choices(req) -> int:
    """Choices generated per prompt: best_of (completions only) or n."""
    return getattr(req, "best_of", None) or req.n


def _best_of(choices: list[_Choice], n: int, keep: int, keep_logprobs: bool) -> list[_Choice]:
    """Of each prompt's n choices, the `keep` with the highest total logprob, re-indexed."""
    out = []
    for start in range(0, len(choices), n):
        group = sorted(choices[start:start + n], key=lambda c: -sum(e["logprob"] for e in c.logprobs or []))
        out += group[:keep]
    for i, c in enumerate(out):
        c.index = i
        c.logprobs = c.logprobs if keep_logprobs else None
    return out


def _legacy_logprobs(entries: list[dict] | None) -> dict | None:
    """The completions API's older parallel-list shape."""
    if entries is None:
        return None
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _first(*values):
    """The request's value, else the model's default, else OpenAI's."""
    return next(v for v in values if v is not None)


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


class _ClosingStreamingResponse(StreamingResponse):
    """Starlette stops a stream on disconnect by cancelling it wherever it waits, possibly before
    the body iterator ever ran; closing the engine streams here aborts their requests either way."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self._streams)
            await self.body_iterator.aclose()


async def _unless_disconnected(raw: Request, work, streams: list[RequestStream]) -> Response:
    """Runs `work`; if the client goes away first, cancels it (its requests abort, blocks free).
    Either way both tasks are awaited here, so no task is left with an unretrieved exception."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        close_all(streams)
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()
