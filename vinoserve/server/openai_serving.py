"""/v1/completions and /v1/chat/completions: requests -> engine streams -> OpenAI responses."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.outputs import RequestOutput
from vinoserve.scheduler.grammar import GrammarSpec
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.echo import PromptScoring, echo_entries, vllm_prompt_logprobs
from vinoserve.server.errors import APIError, bad_value
from vinoserve.server.metrics import Metrics
from vinoserve.server.protocol import ChatCompletionRequest, new_id, now
from vinoserve.server.tools import ToolPlan, parse_reply, render_messages, stream_deltas


@dataclass
class _Choice:
    """One prompt's generation, accumulated."""

    index: int
    prompt_len: int
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None  # the engine's per prompt token (logprob, top, rank)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: Metrics, max_queue: int | None) -> None:
        self.engine, self.model_name, self.metrics, self.max_queue = engine, model_name, metrics, max_queue
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
        if req.n != 1:
            raise APIError(400, "n > 1 is not supported yet; send n separate requests", "n")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        defaults = SamplingParams()
        try:
            bias = tuple((int(t), b) for t, b in (req.logit_bias or {}).items())
        except ValueError as e:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from e
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else max(1, self.engine.engine.max_context - prompt_len),
                temperature=defaults.temperature if req.temperature is None else req.temperature,
                top_p=defaults.top_p if req.top_p is None else req.top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                logit_bias=bias, grammar=grammar, prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise bad_value(e) from e

    def admit(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
              cache_eviction: dict | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Validate, apply --max-queue, and submit: all before the handler next awaits, so
        concurrent requests cannot all slip under the limit."""
        for ids in prompts:
            try:
                self.engine.prepare(ids, params, cache_eviction)
            except ValueError as e:
                raise bad_value(e, "cache_eviction" if str(e).startswith("cache_eviction") else prompt_param) from e
        if self.max_queue is not None and self.engine.num_waiting + len(prompts) > self.max_queue:
            raise APIError(503, f"the server is at capacity ({self.max_queue} requests waiting); retry later",
                           code="overloaded")
        return [self._stream(ids, self.engine.submit(ids, params, cache_eviction=cache_eviction))
                for ids in prompts]

    # ---- engine streams
    async def _stream(self, ids: list[int], outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, with per-token and per-request metrics."""
        last = None
        async for out in outputs:
            t = time.monotonic()
            for _ in out.new_token_ids:
                self.metrics.token(None if last is None else t - last)
                last = t
            if out.finished and out.metrics:
                self.metrics.finished(len(ids), out.metrics)
            yield out

    @staticmethod
    async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts as they come, tagged with the prompt's index. Closing it (a
        client gone, a cancelled task) closes every stream, which aborts unfinished requests."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
                await queue.put((i, e))

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
            for stream in streams:
                await stream.aclose()

    # ---- responses
    async def respond(self, raw: Request, req, prompts: list[list[int]], streams, chat: bool,
                      tools: ToolPlan | None = None, scoring: PromptScoring = PromptScoring()):
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(rid, prompts, streams, chat, include_usage, tools, scoring)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _unless_disconnected(raw, self._complete(rid, prompts, streams, chat, tools, scoring))

    async def _complete(self, rid: str, prompts, streams, chat: bool, tools: ToolPlan | None = None,
                        scoring: PromptScoring = PromptScoring()) -> JSONResponse:
        choices = [_Choice(i, len(p), prompt_ids=p) for i, p in enumerate(prompts)]
        async for i, out in self._merged(streams):
            c = choices[i]
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if scoring.score_only:
                c.finish_reason = "length"
                continue
            c.text += out.new_text
            c.tokens = out.num_output_tokens
            c.finish_reason = out.finish_reason
            if out.new_logprobs is not None:
                c.logprobs = (c.logprobs or []) + self._token_logprobs(out)
        body = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": self.model_name,
            "choices": [self._final_choice(c, chat, tools) for c in choices],
            "usage": _usage(sum(c.prompt_len for c in choices), sum(c.tokens for c in choices)),
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
                message, reason = parse_reply(tools, c.text, reason)
            return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason}
        return {"index": c.index, "text": c.text, "logprobs": _legacy_logprobs(c.logprobs),
                "finish_reason": c.finish_reason}

    async def _sse(self, rid: str, prompts, streams, chat: bool, include_usage: bool,
                   tools: ToolPlan | None = None, scoring: PromptScoring = PromptScoring()) -> AsyncIterator[str]:
        created, obj = now(), "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if chat:
            for i in range(len(prompts)):
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        tokens = [0] * len(prompts)
        try:
            held = [""] * len(prompts)
            echoed = [False] * len(prompts)
            async for i, out in self._merged(streams):
                tokens[i] = out.num_output_tokens
                if tools is not None:  # a reply is a call or an answer only once it is whole
                    held[i] += out.new_text
                    if out.finished:
                        message, reason = parse_reply(tools, held[i], out.finish_reason)
                        for delta in stream_deltas(message):
                            yield event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
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
                    text = self.tokenizer.decode(prompts[i], skip_special_tokens=False) + text
                    if scoring.echo_logprobs is not None:
                        lp = echo_entries(prompts[i], out.prompt_logprobs or [], self._token_entry) + (lp or [])
                if chat:
                    delta = {"content": text} if text or not out.finished else {}
                    choice = {"index": i, "delta": delta, "logprobs": {"content": lp} if lp else None}
                else:
                    choice = {"index": i, "text": text, "logprobs": _legacy_logprobs(lp)}
                    if scoring.prompt_logprobs is not None and out.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompts[i], out.prompt_logprobs,
                                                                         scoring.prompt_logprobs, self._token_entry)
                choice["finish_reason"] = reason if out.finished else None
                yield event([choice])
        except (APIError, ValueError, RuntimeError) as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            return
        if include_usage:
            yield event([], _usage(sum(len(p) for p in prompts), sum(tokens)))
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


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _unless_disconnected(raw: Request, work) -> Response:
    """Runs `work`; if the client goes away first, cancels it (its requests abort, blocks free)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()
