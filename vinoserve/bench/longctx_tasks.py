"""RULER-style long-context tasks, generated offline with a fixed seed, and their scorer.

The tasks follow RULER (arXiv 2404.06654, NVIDIA/RULER's synthetic.yaml) in wording and
scoring: passkey (Mohtashami & Jaggi's "pass key" in repeated filler), needles in a noise or an
essay haystack (single: a number or a UUID; multi-key: three distractor needles; multi-value: four
values of one key; multi-query: four keys asked at once), variable tracking (a chain of four
assignments hidden in filler) and aggregation (the ten common words of a list; the three most
frequent coded words). A sample's prompt plus its answer fit its context length: the haystack is
grown to the most that fits. The question comes after the context ("last", what eviction's
query-aware scoring expects) or before it ("first", query-agnostic: the end of the prompt tells
nothing about what will be asked). A sample scores the share of its expected strings found in the
reply (RULER's string_match_all); the two placements share needles, haystack and answers.
"""
from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vinoserve.model.tokenizer import Tokenizer

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PLACEMENTS = ("last", "first")


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the context: prompt + max_tokens fit in it
    placement: str
    index: int
    prompt_ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_tokens: int

    @property
    def key(self) -> str:
        """Names the sample's exact prompt (a cache key for results)."""
        h = hashlib.sha256(np.asarray(self.prompt_ids, dtype=np.int32).tobytes())
        h.update(repr((self.answers, self.max_tokens)).encode())
        return f"{self.task}-{self.length}-{self.placement}-{self.index}-{h.hexdigest()[:16]}"


def score(reply: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's string_match_all: the share of expected strings in the reply, case-insensitively."""
    text = reply.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


@dataclass(frozen=True)
class _Spec:
    """One sample before fitting: `context(n)` is the context with n haystack units and the answers."""

    intro: str
    question: str
    answer_prefix: str  # starts the assistant's reply when the question is last
    max_tokens: int
    context: Callable[[int], tuple[str, list[str]]]
    max_units: int


def _needles_in(units: list[str], needles: list[str], depths: np.ndarray) -> str:
    """Insert each needle between haystack units at its depth in [0, 1]."""
    out = list(units)
    for depth, needle in sorted(zip(depths, needles), key=lambda p: -p[0]):
        out.insert(int(round(depth * len(units))), needle)
    return " ".join(out)


class _Words:
    """Pools drawn from offline English text: plain words and haystack sentences."""

    def __init__(self, haystack: str) -> None:
        self.sentences = [s for s in re.split(r"(?<=[.!?]) +", haystack) if s]
        from vinoserve.bench.workloads import stdlib_english

        self.words = sorted(set(re.findall(r"\b[a-z]{4,10}\b", stdlib_english() + " " + haystack)))


def _haystack(words: _Words, kind: str, rng: np.random.Generator) -> Callable[[int], list[str]]:
    if kind == "noise":
        return lambda n: [NOISE] * n
    start = int(rng.integers(len(words.sentences)))
    return lambda n: [words.sentences[(start + i) % len(words.sentences)] for i in range(n)]


def _niah(words: _Words, rng: np.random.Generator, length: int, haystack: str, value: str, num_keys: int = 1,
          num_values: int = 1, num_queries: int = 1) -> _Spec:
    kind = "uuids" if value == "uuid" else "numbers"

    def draw_value() -> str:
        return str(uuid.UUID(bytes=rng.bytes(16), version=4)) if value == "uuid" else str(rng.integers(10**6, 10**7))

    keys = ["-".join(rng.choice(words.words, 2, replace=False)) for _ in range(max(num_keys, num_queries))]
    needles, values = [], {}
    for k in keys:
        values[k] = [draw_value() for _ in range(num_values)]
        needles += [f"One of the special magic {kind} for {k} is: {v}." for v in values[k]]
    asked = keys[:num_queries]
    query = ", ".join(asked[:-1]) + f", and {asked[-1]}" if len(asked) > 1 else asked[0]
    answers = [v for k in asked for v in values[k]]
    depths, units = rng.uniform(0, 1, len(needles)), _haystack(words, haystack, rng)
    return _Spec(f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 f"I will quiz you about the {kind} afterwards.",
                 f"What are all the special magic {kind} for {query} mentioned in the provided text?",
                 f"The special magic {kind} for {query} mentioned in the provided text are",
                 12 * len(answers) + (24 if value == "uuid" else 4),
                 lambda n: (_needles_in(units(n), needles, depths), answers), 4000)


def _passkey(words: _Words, rng: np.random.Generator, length: int) -> _Spec:
    key = str(rng.integers(10**4, 10**5))
    depth = rng.uniform(0, 1, 1)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return _Spec("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.", "What is the pass key?",
                 "The pass key is", 12, lambda n: (_needles_in([NOISE] * n, [needle], depth), [key]), 4000)


def _variable_tracking(words: _Words, rng: np.random.Generator, length: int) -> _Spec:
    names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5)) for _ in range(5)]
    value = str(rng.integers(10**4, 10**5))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = np.sort(rng.uniform(0, 1, len(chain)))  # in order, so the chain reads forwards
    return _Spec("Memorize and track the chain(s) of variable assignment hidden in the following text.",
                 f"Question: Find all variables that are assigned the value {value} in the text above.",
                 f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} "
                 f"variables are assigned the value {value}, they are:", 32,
                 lambda n: (_needles_in([NOISE] * n, chain, depths), names), 4000)


def _common_words(words: _Words, rng: np.random.Generator, length: int) -> _Spec:
    pool = [str(w) for w in rng.choice(words.words, 1200, replace=False)]
    common, rare = pool[:10], pool[10:]
    seed = int(rng.integers(2**31))
    repeats = min(30, max(6, length // 128))  # RULER's 30 at 4K; a short list holds fewer

    def context(n: int) -> tuple[str, list[str]]:
        listed = common * repeats + [w for w in rare[:n] for _ in range(3)]
        np.random.default_rng(seed).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    return _Spec("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.",
                 "Question: What are the 10 most common words in the above list?",
                 "Answer: The top 10 words that appear most often in the list are:", 64, context, len(rare))


def _frequent_words(words: _Words, rng: np.random.Generator, length: int) -> _Spec:
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 5)) for _ in range(2000)]
    seed = int(rng.integers(2**31))

    def context(n: int) -> tuple[str, list[str]]:
        r = np.random.default_rng(seed)
        ranks = np.minimum(r.zipf(2.0, n), len(vocab)) - 1
        drawn = [vocab[i] for i in ranks]
        counts = np.bincount(ranks, minlength=3)
        top = [vocab[i] for i in np.argsort(-counts, kind="stable")[:3]]
        return " .... ".join(drawn), top

    return _Spec("Read the following coded text and track the frequency of each coded word. Find the three "
                 "most frequently appeared coded words.",
                 "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                 "most frequently appeared words in the above coded text?",
                 "Answer: According to the coded text above, the three most frequently appeared words are:", 24,
                 context, 6000)


TASKS: dict[str, Callable[[_Words, np.random.Generator, int], _Spec]] = {
    "passkey": _passkey,
    "niah_single_1": lambda w, r, n: _niah(w, r, n, "noise", "number"),
    "niah_single_2": lambda w, r, n: _niah(w, r, n, "essay", "number"),
    "niah_single_3": lambda w, r, n: _niah(w, r, n, "essay", "uuid"),
    "niah_multikey_1": lambda w, r, n: _niah(w, r, n, "essay", "number", num_keys=4),
    "niah_multivalue": lambda w, r, n: _niah(w, r, n, "essay", "number", num_values=4),
    "niah_multiquery": lambda w, r, n: _niah(w, r, n, "essay", "number", num_keys=4, num_queries=4),
    "vt": _variable_tracking,
    "cwe": _common_words,
    "fwe": _frequent_words,
}
SINGLE_NEEDLE_TASKS = ("passkey", "niah_single_1", "niah_single_2", "niah_single_3")


class Generator:
    """Samples for one tokenizer and haystack; the same arguments always give the same token ids."""

    def __init__(self, tokenizer: Tokenizer, haystack: str, seed: int = 0) -> None:
        self.tokenizer, self.seed = tokenizer, seed
        self.words = _Words(haystack)

    def sample(self, task: str, length: int, placement: str, index: int) -> Sample:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
        task_id = int(hashlib.sha256(task.encode()).hexdigest()[:8], 16)
        spec = TASKS[task](self.words, np.random.default_rng([self.seed, task_id, length, index]), length)
        budget = length - spec.max_tokens
        # The most haystack units whose prompt fits: estimated from two short prompts, then searched
        # near the estimate (tokenizing a prompt far longer than the context costs seconds).
        base, probe = len(self._prompt(spec, 0, placement)[0]), min(64, spec.max_units)
        per_unit = max((len(self._prompt(spec, probe, placement)[0]) - base) / max(probe, 1), 1e-3)
        lo, hi = 0, min(spec.max_units, int(1.2 * (budget - base) / per_unit) + 2)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._prompt(spec, mid, placement)[0]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        ids, answers = self._prompt(spec, lo, placement)
        if len(ids) > budget:
            raise ValueError(f"{task}: even an empty haystack does not fit {length} tokens")
        return Sample(task, length, placement, index, tuple(ids), tuple(answers), spec.max_tokens)

    def _prompt(self, spec: _Spec, units: int, placement: str) -> tuple[list[int], list[str]]:
        return _render(self.tokenizer, spec, units, placement)


def _render(tokenizer: Tokenizer, spec: _Spec, units: int, placement: str) -> tuple[list[int], list[str]]:
    context, answers = spec.context(units)
    if placement == "last":
        user, prefix = f"{spec.intro}\n\n{context}\n\n{spec.question}", spec.answer_prefix
    else:  # the reply starts with nothing that names what was asked
        user, prefix = f"{spec.intro} {spec.question}\n\n{context}", "Answer:"
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}]) + prefix
    return tokenizer.encode(text, add_special_tokens=False), answers
