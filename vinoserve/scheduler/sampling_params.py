"""Per-request sampling settings, with vLLM / OpenAI semantics and defaults."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from vinoserve.scheduler.grammar import GrammarSpec

# Below this a temperature is treated as greedy, as vLLM does: dividing by it would
# only turn the softmax into an argmax with extra rounding.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # the OpenAI API's cap on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and output tokens; 1: off
    presence_penalty: float = 0.0  # on output tokens only
    frequency_penalty: float = 0.0  # on output tokens only
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # k: the chosen token's logprob plus the top k
    stop: tuple[str, ...] = ()  # matched on text by the engine's detokenizer
    n: int = 1
    prompt_logprobs: int | None = None  # k: each prompt token's logprob plus the top k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's map
    grammar: GrammarSpec | None = None  # structured output: every token must keep the grammar satisfiable
    # False: special tokens (other than the one that ends the sequence) are text too, e.g. for a
    # tool-call format whose calls open with one ([TOOL_CALLS], <|python_tag|>)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # JSON gives lists; tuples keep the params hashable and concatenable with EOS ids.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def choice(self, index: int) -> SamplingParams:
        """The settings of choice `index` of n: one choice, with seed + index when seeded, so
        the choices are reproducible and different."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    def ends_at(self, token: int, eos_token_ids: Collection[int]) -> bool:
        """Whether sampling `token` ends the sequence (a stop token, or EOS unless ignored)."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    def validate(self) -> None:
        # `not (a <= x <= b)` rather than `x < a or x > b` so that NaN is rejected too.
        # The engine samples at least one token per request, as vLLM does.
        if not self.max_tokens >= 1:
            _fail("max_tokens", "must be >= 1", self.max_tokens)
        if not self.temperature >= 0:
            _fail("temperature", "must be >= 0", self.temperature)
        if not 0 < self.top_p <= 1:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        if not self.top_k >= -1:
            _fail("top_k", "must be -1 or 0 (off) or a positive count", self.top_k)
        if not 0 <= self.min_p <= 1:
            _fail("min_p", "must be in [0, 1]", self.min_p)
        if not self.repetition_penalty > 0:
            _fail("repetition_penalty", "must be > 0", self.repetition_penalty)
        if not -2 <= self.presence_penalty <= 2:
            _fail("presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        if not -2 <= self.frequency_penalty <= 2:
            _fail("frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _fail("logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            _fail("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", f"must be in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                _fail("logit_bias", "maps token ids >= 0 to values in [-100, 100]", {token: bias})
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "must be token ids >= 0", list(self.stop_token_ids))
        if self.n < 1:
            _fail("n", "must be >= 1", self.n)

    def check_vocabulary(self, vocab_size: int, eos_token_ids: Collection[int] = ()) -> None:
        """ValueError naming the field that holds a token id outside [0, vocab_size): the sampler
        indexes the logits row with them (a stop token held back by min_tokens, a biased one);
        or whose stop tokens, with EOS, are every token, which min_tokens would all hold back."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            if outside := [t for t in ids if not 0 <= t < vocab_size]:
                _fail(name, f"must be token ids in [0, {vocab_size})", outside[0])
        if self.min_tokens and len({*self.stop_token_ids, *eos_token_ids}) >= vocab_size:
            _fail("stop_token_ids", "with EOS may not be every token while min_tokens holds them back",
                  f"{len(set(self.stop_token_ids))} ids")


def _fail(name: str, rule: str, value: object) -> None:
    raise ValueError(f"{name} {rule}, got {value!r}")
