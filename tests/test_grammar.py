"""The grammar module on SmolLM2's real vocabulary: control tokens never match text, a complete
grammar leaves only the stop tokens, masks and logit_bias compose in the sampler, bad specs fail."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vinoserve.model.tokenizer import Tokenizer
from vinoserve.scheduler.grammar import GrammarCompiler, GrammarSpec, apply_grammar_masks
from vinoserve.scheduler.sampler import Sampler, SamplingState
from vinoserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
STOPS = (2, 0)  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.token_bytes, len(tok.token_bytes), STOPS, sorted(tok.special_token_ids),
                           lambda s: tok.encode(s, add_special_tokens=False))


def allowed(state, vocab: int) -> np.ndarray:
    logits = np.zeros((1, vocab), np.float32)
    apply_grammar_masks(logits, [0], [state])
    return np.flatnonzero(logits[0] == 0)


def feed(state, tok, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        state.accept(t)
    assert state.error is None


def test_control_tokens_never_match_text_and_stops_only_at_the_end(tok, compiler):
    vocab = len(tok.token_bytes)
    state = compiler.matcher(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}},
                                                      "required": ["a"]}))
    feed(state, tok, '{"a": "x')
    inside = allowed(state, vocab)
    assert len(inside) > 1000  # free text
    assert not set(inside) & set(tok.special_token_ids)  # <|im_start|>, <file_sep>... are not text
    feed(state, tok, '"}')
    assert set(allowed(state, vocab)) == set(STOPS)  # complete: only a stop token may follow


def test_choice_and_regex_allow_exactly_their_language(tok, compiler):
    vocab = len(tok.token_bytes)
    state = compiler.matcher(GrammarSpec("choice", json.dumps(["yes", "no"])))
    first = {tok.token_bytes[t] for t in allowed(state, vocab)}
    assert first and all(b"yes".startswith(b) or b"no".startswith(b) for b in first)
    state = compiler.matcher(GrammarSpec("regex", "[0-9]{2}"))
    feed(state, tok, "4")
    assert {tok.token_bytes[t] for t in allowed(state, vocab)} == {str(d).encode() for d in range(10)}


def test_sampler_masks_and_biases_rows_independently(tok, compiler):
    vocab = len(tok.token_bytes)
    digit = tok.encode("7", add_special_tokens=False)[0]
    letter = tok.encode("q", add_special_tokens=False)[0]
    logits = np.zeros((3, vocab), np.float32)
    logits[:, letter] = 50.0  # every row's greedy pick, unless masked or biased
    greedy = SamplingParams(temperature=0)
    rows = [SamplingState(greedy, [1], [], STOPS, compiler.matcher(GrammarSpec("regex", "[0-9]"))),
            SamplingState(SamplingParams(temperature=0, logit_bias={digit: 100}), [1], [], STOPS),
            SamplingState(SamplingParams(temperature=0, logit_bias={letter: 100}), [1], [], STOPS,
                          compiler.matcher(GrammarSpec("regex", "[0-9]")))]
    out = Sampler().sample(logits, rows)
    assert tok.token_bytes[out.token_ids[0]].isdigit()  # the mask wins over the greedy letter
    assert out.token_ids[1] == digit  # +100 forces
    assert tok.token_bytes[out.token_ids[2]].isdigit()  # a bias cannot lift a forbidden token
    assert logits[0, letter] == 50.0  # the caller's logits are untouched (logprobs read them raw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_stops_back_only_while_the_grammar_allows_more(tok, compiler, temperature):
    vocab = len(tok.token_bytes)
    complete = compiler.matcher(GrammarSpec("choice", json.dumps(["yes"])))
    feed(complete, tok, "yes")  # nothing but a stop may follow
    open_ended = compiler.matcher(GrammarSpec("regex", "yes( no)*"))
    feed(open_ended, tok, "yes")  # may stop, or go on
    logits = np.zeros((2, vocab), np.float32)
    logits[:, STOPS[0]] = 50.0  # the model wants to stop
    params = SamplingParams(temperature=temperature, min_tokens=10, seed=1)
    rows = [SamplingState(params, [1], [5], STOPS, complete), SamplingState(params, [1], [5], STOPS, open_ended)]
    out = Sampler().sample(logits, rows).token_ids
    assert out[0] in STOPS  # the grammar wins: any other token would break the output
    assert out[1] in set(allowed(open_ended, vocab)) - set(STOPS)  # min_tokens holds the stop back


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema({"type": "nonsense"}), GrammarSpec("regex", "a(b"),
                                  GrammarSpec("lark", "root ::= missing"), GrammarSpec("choice", "[]")])
def test_bad_specs_raise_value_error(compiler, spec):
    with pytest.raises(ValueError):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_and_states_independent(tok, compiler):
    spec = GrammarSpec("regex", "[a-z]+")
    assert compiler.compile(spec) is compiler.compile(spec)
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    feed(a, tok, "abc")
    assert set(STOPS) <= set(allowed(a, len(tok.token_bytes)))  # "abc" may end here
    assert not set(STOPS) & set(allowed(b, len(tok.token_bytes)))  # the untouched copy needs a letter first
