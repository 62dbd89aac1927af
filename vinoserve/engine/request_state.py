"""One request inside the engine: its sequence, text, sampling and metrics, and the tokens picked
for it, turned into the deltas the engine hands back."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vinoserve.engine.evictor import SequenceEviction
from vinoserve.engine.outputs import RequestMetrics, RequestOutput
from vinoserve.engine.prompt_logprobs import PromptLogprobs
from vinoserve.engine.text_output import TextOutput
from vinoserve.scheduler.sampler import Sampler, SamplingState
from vinoserve.scheduler.sequence import Sequence


class Pick(NamedTuple):
    """A sampled token, its logprob, and the top alternatives when the request asked for them."""

    token: int
    logprob: float
    top: list | None


@dataclass(eq=False)
class RequestState:
    seq: Sequence
    text: TextOutput
    sampling: SamplingState
    metrics: RequestMetrics
    eviction: SequenceEviction | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def append(self, pick: Pick, eos_token_ids: tuple[int, ...]) -> tuple[str, str | None]:
        """Adds a picked token: its text, and why the request ends with it (None: it goes on)."""
        seq, params = self.seq, self.seq.params
        if self.sampling.grammar is not None:  # here, not in the sampler: a batch sampled again after
            self.sampling.grammar.accept(pick.token)  # a fault must not advance a matcher twice
        if seq.num_pending_tokens:  # the token its launch counted in
            seq.num_pending_tokens -= 1
        seq.output_token_ids.append(pick.token)
        self.metrics.first_token_time = self.metrics.first_token_time or time.monotonic()
        reason = None
        if params.ends_at(pick.token, eos_token_ids):
            reason, text = "stop", ""
        else:
            text = self.text.add(pick.token)
            if self.text.stopped:
                reason = "stop"
        # check_request keeps prompt + max_tokens within the context, so max_tokens is the only length limit.
        if reason is None and len(seq.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            text += self.text.flush()
        return text, reason

    def output(self, tokens: list[int], text: str, pick: Pick | None = None) -> RequestOutput:
        seq = self.seq
        logprobs = [(pick.logprob, pick.top or [])] if pick is not None and seq.params.logprobs is not None else None
        out = RequestOutput(seq.request_id, seq.prompt_token_ids, tokens, text,
                            finished=seq.status.is_finished, finish_reason=seq.finish_reason,
                            stop_string=self.text.stop_string, num_output_tokens=len(seq.output_token_ids),
                            new_logprobs=logprobs, metrics=self.metrics, num_cached_tokens=seq.num_cached_prompt_tokens)
        if tokens and self.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs.take()
        return out


def sample(sampler: Sampler, rows: np.ndarray, reqs: list[RequestState]) -> list[Pick | Exception]:
    """One token per request. If the batch raises, each request is sampled alone, so only the one
    whose sampling fails is failed (its seeded neighbours may draw anew this step)."""
    try:
        out = sampler.sample(rows, [r.sampling for r in reqs])
        return [Pick(int(out.token_ids[i]), float(out.logprobs[i]), out.top_logprobs[i]) for i in range(len(reqs))]
    except Exception:  # noqa: BLE001 - isolated per request below
        picks: list[Pick | Exception] = []
        for i, r in enumerate(reqs):
            try:
                out = sampler.sample(rows[i:i + 1], [r.sampling])
                picks.append(Pick(int(out.token_ids[0]), float(out.logprobs[0]), out.top_logprobs[0]))
            except Exception as e:  # noqa: BLE001
                picks.append(e)
        return picks
