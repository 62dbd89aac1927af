"""Streaming text: the concatenated deltas equal a full decode, and no delta holds half a character."""
from __future__ import annotations

import pytest

from vinoserve.engine.detokenize import IncrementalDetokenizer
from vinoserve.engine.text_output import TextOutput
from vinoserve.model.tokenizer import Tokenizer

TEXT = "Héllo wörld 你好，世界 🎉🧑‍🚀 emoji\tcode  x = {\"a\": 1}\n<|im_end|> naïve — done"


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_the_full_decode(tok, skip):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some emoji really are split across byte-level tokens


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok):
    ids = tok.encode("The answer is forty-two. Then more text follows.", add_special_tokens=False)
    out = TextOutput(tok, stop=("two. Th",))
    streamed = ""
    for i in ids:
        streamed += out.add(i)
        if out.stopped:
            break
    assert out.stopped and streamed == "The answer is forty-" and out.flush() == ""


def test_held_back_tail_is_released_at_the_end(tok):
    ids = tok.encode("abc xyz", add_special_tokens=False)
    out = TextOutput(tok, stop=("never appears",))
    text = "".join(out.add(i) for i in ids)
    assert len(text) < len("abc xyz") and text + out.flush() == "abc xyz"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_text_only_when_asked(tok, skip):
    """A tool-call format whose calls open with a special token needs to see it (SamplingParams)."""
    ids = tok.encode("a<|im_end|>b", add_special_tokens=False)
    out = TextOutput(tok, skip_special_tokens=skip)
    text = "".join(out.add(i) for i in ids) + out.flush()
    assert text == ("ab" if skip else "a<|im_end|>b")
