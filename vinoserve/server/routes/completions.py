"""POST /v1/completions: raw prompts (text or token ids, one or many), with the features only this
API has: `echo` and prompt-only scoring, `best_of`, vLLM's per-choice `prompt_logprobs`, `suffix`."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from vinoserve.model.tokenizer import Tokenizer
from vinoserve.server.delivery import error_event, event_stream_response, sse, unless_disconnected
from vinoserve.server.echo import PromptScoring, echo_entries, fill_in_the_middle, prompt_scoring, vllm_prompt_logprobs
from vinoserve.server.errors import APIError
from vinoserve.server.event_stream import collect
from vinoserve.server.events import ChoiceResult, Logprobs, PromptLogprobs, Step, TextDelta, Usage
from vinoserve.server.logprobs import legacy_logprobs, token_entry
from vinoserve.server.protocol import CompletionRequest, new_id, now
from vinoserve.server.serving import Serving, current, num_choices
from vinoserve.server.structured import grammar_for

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, serving: Serving = Depends(current)) -> Response:
    serving.check_model(req.model)
    serving.limits.check_request(req)
    prompts = await asyncio.to_thread(completion_prompts, serving.tokenizer, req.prompt)  # big prompts take ms
    if req.suffix is not None:
        prompts = fill_in_the_middle(serving.tokenizer, prompts, req.suffix)
    serving.limits.check_prompts(prompts, "prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    scoring = prompt_scoring(req, True, max_tokens)
    grammar = await grammar_for(req, serving.engine.grammars)
    params = serving.sampling_params(req, 1 if scoring.score_only else max_tokens, max(map(len, prompts)),
                                     req.logprobs, grammar, scoring.engine_k)
    n = num_choices(req)
    streams = serving.admit(prompts, params, "prompt", req.cache_eviction, n)
    events = serving.events(prompts, streams)
    out = _Render(serving, new_id("cmpl"), prompts, n, scoring)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream_response(out.chunks(events, include_usage), streams)
    # With best_of > n the logprobs were computed to rank the choices; shown only if asked for.
    shown = n == req.n or req.logprobs is not None
    return await unless_disconnected(raw, out.reply(events, req.n, shown), streams)


def completion_prompts(tokenizer: Tokenizer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


class _Render:
    """One request's events as text_completion objects; choice i continues prompt i // n."""

    def __init__(self, serving: Serving, rid: str, prompts: list[list[int]], n: int, scoring: PromptScoring) -> None:
        self.serving, self.rid, self.prompts, self.n, self.scoring = serving, rid, prompts, n, scoring

    def entry(self, token: int, logprob: float) -> dict:
        return token_entry(self.serving.tokenizer, token, logprob)

    async def reply(self, events: AsyncIterator[Step | Usage], keep: int, keep_logprobs: bool) -> JSONResponse:
        """n choices per prompt came back; `keep` of them (the most likely first) are returned."""
        results, usage = await collect(events, len(self.prompts) * self.n)
        if self.scoring.score_only:  # the one token generated to compute the prompt is not an output
            results = [replace(r, text="", logprobs=None, finish_reason="length") for r in results]
            usage = replace(usage, completion_tokens=0)
        pairs = [(r, self.prompts[r.index // self.n]) for r in results]
        if keep < self.n:
            pairs = _best_of(pairs, self.n, keep, keep_logprobs)
        choices = []
        for r, prompt in pairs:
            choice = {"index": r.index, "text": r.text, "logprobs": legacy_logprobs(r.logprobs),
                      "finish_reason": r.finish_reason}
            if self.scoring.echo:
                choice["text"] = self.serving.tokenizer.decode(prompt, skip_special_tokens=False) + r.text
                if self.scoring.echo_logprobs is not None:
                    entries = echo_entries(prompt, r.prompt_logprobs or [], self.entry)
                    choice["logprobs"] = legacy_logprobs(entries + (r.logprobs or []))
            if (k := self.scoring.prompt_logprobs) is not None:  # per choice, as vLLM does
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, r.prompt_logprobs or [], k, self.entry)
            choices.append(choice)
        return JSONResponse({"id": self.rid, "object": "text_completion", "created": now(),
                             "model": self.serving.model_name, "choices": choices, "usage": usage.openai()})

    async def chunks(self, events: AsyncIterator[Step | Usage], include_usage: bool) -> AsyncIterator[str]:
        created, echoed = now(), set()

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": self.rid, "object": "text_completion", "created": created,
                    "model": self.serving.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        try:
            async for item in events:
                if isinstance(item, Usage):
                    if include_usage:
                        completion = 0 if self.scoring.score_only else item.completion_tokens
                        yield chunk([], replace(item, completion_tokens=completion).openai())
                    continue
                yield chunk([self._choice(item, echoed)])
        except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse(error_event(e))
            return
        yield sse("[DONE]")

    def _choice(self, step: Step, echoed: set[int]) -> dict:
        """One chunk per step, even one that completes no character: clients time every token."""
        i, prompt = step.index, self.prompts[step.index // self.n]
        text = "".join(e.text for e in step.events if isinstance(e, TextDelta))
        lp = next((e.entries for e in step.events if isinstance(e, Logprobs)), None)
        scored = next((e.scored for e in step.events if isinstance(e, PromptLogprobs)), None)
        finish = step.finish()
        reason = finish.reason if finish else None
        if self.scoring.score_only:
            text, lp, reason = "", None if lp is None else [], "length"
        if self.scoring.echo and i not in echoed:  # the first output: the prompt is scored by now
            echoed.add(i)
            text = self.serving.tokenizer.decode(prompt, skip_special_tokens=False) + text
            if self.scoring.echo_logprobs is not None:
                lp = echo_entries(prompt, scored or [], self.entry) + (lp or [])
        choice = {"index": i, "text": text, "logprobs": legacy_logprobs(lp)}
        if self.scoring.prompt_logprobs is not None and scored is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, scored, self.scoring.prompt_logprobs, self.entry)
        choice["finish_reason"] = reason if finish else None
        return choice


def _best_of(pairs: list[tuple[ChoiceResult, list[int]]], n: int, keep: int,
             keep_logprobs: bool) -> list[tuple[ChoiceResult, list[int]]]:
    """Of each prompt's n choices, the `keep` with the highest total logprob, re-indexed."""
    out = []
    for start in range(0, len(pairs), n):
        group = sorted(pairs[start:start + n], key=lambda p: -sum(e["logprob"] for e in p[0].logprobs or []))
        out += group[:keep]
    return [(replace(r, index=i, logprobs=r.logprobs if keep_logprobs else None), prompt)
            for i, (r, prompt) in enumerate(out)]
