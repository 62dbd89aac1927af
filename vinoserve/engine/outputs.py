"""What the engine hands back per request per step: deltas, so streaming costs O(new tokens)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_string: str | None = None  # with finish_reason "stop": the stop string that ended it (vLLM's stop_reason)
    num_output_tokens: int = 0  # all generated so far, the stop token included
    # Per new token: (logprob of the chosen token, top alternatives) when the request asked.
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    error: str | None = None  # set, with finish_reason "error", when this request's own handling failed
    # With prompt_logprobs, on the first output: per prompt token (logprob, top), None for the first
    prompt_logprobs: list | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This step's output followed by `later` (more tokens of the same request, same step)."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        if later.new_logprobs is not None:
            self.new_logprobs = (self.new_logprobs or []) + later.new_logprobs
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.stop_string = later.stop_string
        self.num_output_tokens = later.num_output_tokens
        return self


@dataclass
class CompletionOutput:
    """A finished request, accumulated (the offline API's result)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
