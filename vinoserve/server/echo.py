"""Prompt scoring: completions' `echo` (the prompt, and with `logprobs` its tokens' logprobs, before
the output; `max_tokens: 0` scores the prompt only) and vLLM's `prompt_logprobs` on both endpoints."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vinoserve.server.errors import APIError


@dataclass(frozen=True)
class PromptScoring:
    echo: bool = False  # completions: the prompt text (and its logprobs) come first
    score_only: bool = False  # max_tokens 0: the one token the engine must generate is dropped
    echo_logprobs: int | None = None  # echo with logprobs k: prompt tokens' entries lead the logprobs
    prompt_logprobs: int | None = None  # vLLM's field as asked: top k per prompt token

    @property
    def engine_k(self) -> int | None:
        """The prompt_logprobs the engine must compute for this request."""
        ks = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        return max(ks) if ks else None


def prompt_scoring(req, completions: bool, max_tokens: int | None) -> PromptScoring:
    echo = completions and req.echo
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 needs echo: true (scoring the prompt only)", "max_tokens")
    return PromptScoring(echo, max_tokens == 0, req.logprobs if echo else None, req.prompt_logprobs)


def echo_entries(prompt_ids: list[int], scored: list, entry: Callable[[int, float], dict]) -> list[dict]:
    """Prompt tokens as logprob entries (the first has no logprob), like the output's own."""
    out = []
    for token, s in zip(prompt_ids, scored):
        e = entry(token, 0.0)
        if s is None:
            e["logprob"], e["top_logprobs"] = None, None
        else:
            e["logprob"] = max(s[0], -9999.0)
            e["top_logprobs"] = [entry(t, lp) for t, lp in s[1]]
        out.append(e)
    return out


def vllm_prompt_logprobs(prompt_ids: list[int], scored: list, k: int,
                         entry: Callable[[int, float], dict]) -> list[dict | None]:
    """vLLM's shape: per prompt token None or {id: {logprob, rank, decoded_token}} (itself plus top k)."""
    out: list[dict | None] = []
    for token, s in zip(prompt_ids, scored):
        if s is None:
            out.append(None)
            continue
        logprob, top, rank = s
        ranked = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": entry(t, lp)["token"]}
                  for r, (t, lp) in enumerate(top[:k])}
        ranked[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": entry(token, logprob)["token"]}
        out.append(ranked)
    return out


_FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")  # StarCoder's names, which SmolLM2 shares


def _fim_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in _FIM]


def has_fim(tokenizer) -> bool:
    """Whether the model has fill-in-the-middle tokens, each a single special token."""
    return all(len(i) == 1 and i[0] in tokenizer.special_token_ids for i in _fim_ids(tokenizer))


def fill_in_the_middle(tokenizer, prompts: list[list[int]], suffix: str) -> list[list[int]]:
    """Completions' `suffix`: prefix-suffix-middle prompts for models with FIM tokens, else a 400
    (an empty suffix, nothing after the completion, is a plain completion on any model)."""
    if not has_fim(tokenizer):
        if not suffix:
            return prompts
        raise APIError(400, "suffix needs a model with fill-in-the-middle tokens; this one has none", "suffix")
    (pre,), (suf,), (mid,) = _fim_ids(tokenizer)
    tail = tokenizer.encode(suffix, add_special_tokens=False)
    return [[pre, *p, suf, *tail, mid] for p in prompts]
