"""Token-level constraints (JSON schema, regex, choice, Lark grammar) through llguidance.

Grammars compile once per spec (an LRU shared by all requests); each sequence gets its own
matcher, a cheap copy of the compiled one. Every step, the rows that carry a matcher get their
allowed-token bitmask filled in one batched call and every forbidden logit pushed far below
reach (probability exactly 0); once a grammar is complete only the stop tokens remain allowed,
so the request ends with EOS.

llguidance rather than xgrammar (which needs torch to import) or outlines-core (regex only, and
a compiled index per schema costs tens of ms): see docs/structured-outputs.md; the per-step cost
is measured by benchmarks/grammar_masks.py.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import llguidance
import llguidance.numpy
from llguidance.gbnf_to_lark import any_to_lark
import numpy as np

_log = logging.getLogger(__name__)
KINDS = ("json_schema", "regex", "choice", "lark", "composed")
_CACHE_SIZE = 256
# How JSON is written under a schema (llguidance's options; in Lark, a `%json` schema's "x-guidance"):
# compact separators and no free whitespace between tokens, since a small model fed "any
# whitespace" tends to spend its whole budget on newlines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; hashable, so it keys the compile cache."""

    kind: str  # one of KINDS
    # A JSON schema (as JSON text), a regex, a JSON list of choices, a Lark/GBNF grammar, or for
    # "composed" {"lark": outer grammar, "inner": [kind, source]} as JSON text (see `composed`).
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the output's property order

    @classmethod
    def composed(cls, lark: str, inner: GrammarSpec) -> GrammarSpec:
        """A Lark grammar whose rules refer to `inner` as `@inner`, e.g. free reasoning text up to a
        closing tag and then `inner`: `start: THINK @inner` (llguidance's nested grammars, each
        with its own lexer, so a JSON schema keeps its whitespace rules inside)."""
        if inner.kind == "composed":
            raise ValueError("a composed grammar cannot nest another composed grammar")
        return cls("composed", json.dumps({"lark": lark, "inner": [inner.kind, inner.source]}))

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec; ValueError when the spec itself is malformed."""
        if self.kind == "composed":
            outer = json.loads(self.source)
            inner = _top_level(GrammarSpec(*outer["inner"]).grammar_text())["grammars"]
            if len(inner) != 1:
                raise ValueError("the inner grammar of a composed grammar must be a single grammar")
            return json.dumps({"grammars": [{"lark_grammar": outer["lark"]}, {**inner[0], "name": "inner"}]})
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_STYLE)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            alternatives = " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.source))  # Lark or llama.cpp GBNF


def _top_level(text: str) -> dict:
    """llguidance's grammar texts are either its JSON TopLevelGrammar or plain Lark."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and "grammars" in value:
            return value
    return {"grammars": [{"lark_grammar": text}]}


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe, so the server compiles off the engine thread."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int],
                 special_token_ids: Sequence[int], encode: Callable[[str], list[int]]) -> None:
        self.vocab_size = vocab_size
        self._args = (list(token_bytes), vocab_size, list(stop_token_ids), list(special_token_ids), encode)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use: it takes ~0.1 s for a 49k vocabulary, wasted on servers never asked.
        if self._tokenizer is None:
            tokens, vocab, stops, special, encode = self._args
            # Control tokens (<|im_start|>...) must never match text: they are special here,
            # and ids past the tokenizer's table (padding rows of the logits) are empty.
            tokens = tokens[:vocab] + [b""] * (vocab - len(tokens))
            wrapper = _Wrapper(tokens, stops[0], sorted(set(special) | set(stops)), encode)
            self._tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=stops)
        return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled matcher for `spec` (shared: copy it before use); ValueError naming the problem."""
        with self._lock:
            if (hit := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return hit
            tokenizer = self._llg_tokenizer()
        try:
            text = spec.grammar_text()
        except Exception as e:  # noqa: BLE001 - llguidance's GBNF converter raises bare Exception on user input
            raise ValueError(str(e)) from e
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        for warning in matcher.get_grammar_warnings():  # once per grammar: later requests hit the cache
            _log.warning("grammar compiled without what llguidance cannot enforce: %s", warning)
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        """Fresh per-sequence state for `spec`."""
        return GrammarState(self.compile(spec).deep_copy())


class _Wrapper(llguidance.TokenizerWrapper):
    """The duck-typed tokenizer llguidance.LLTokenizer reads."""

    def __init__(self, tokens: list[bytes], eos: int, special: list[int], encode: Callable[[str], list[int]]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = special
        self.is_tokenizer_wrapper = True
        self._encode = encode

    def __call__(self, s: str | bytes) -> list[int]:
        return self._encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)


@dataclass(eq=False)
class GrammarState:
    """One sequence's position in its grammar."""

    matcher: llguidance.LLMatcher

    def accept(self, token: int) -> None:
        """Advance past a sampled token; the mask made any other token impossible."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


_executor: llguidance.LLExecutor | None = None


def apply_grammar_masks(logits: np.ndarray, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
    """Pushes out of reach, in place, every token that the grammar of logits row rows[i] forbids."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    vocab = logits.shape[1]
    mask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab)
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    sub = logits[rows]
    forbidden = np.broadcast_to(_forbidden_values(vocab), sub.shape)
    np.copyto(sub, forbidden, where=~allowed)
    logits[rows] = sub


FORBIDDEN = np.float32(-1e30)  # a forbidden token's logit is this or below; no real logit comes near


@lru_cache(maxsize=4)
def _forbidden_values(vocab: int) -> np.ndarray:
    """What a forbidden token's logit becomes: far below any real logit, so its probability is exactly
    0 and argmax never picks it, yet all distinct. A row of tens of thousands of equal -inf values
    makes numpy's argpartition (top-k) ~20x slower (53 ms against 2.5 ms for 4 x 49k rows)."""
    return (FORBIDDEN - np.arange(vocab, dtype=np.float32) * np.float32(1e25)).astype(np.float32)
