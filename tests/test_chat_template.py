"""SmolLM2's chat template, rendered by us, equals HF transformers' apply_chat_template."""
from __future__ import annotations

import pytest

from vinoserve.model.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Now in words, with émojis 🎉 and\nnewlines."}],
]


@pytest.fixture(scope="module")
def both(smollm2_gguf, smollm2_hf_tokenizer):
    return Tokenizer.from_gguf(smollm2_gguf), smollm2_hf_tokenizer


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_hf(both, messages, add_generation_prompt):
    ours, hf = both
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_template_errors_are_value_errors(both):
    ours, _ = both
    ours_broken = Tokenizer.__new__(Tokenizer)
    ours_broken.__dict__.update(ours.__dict__)
    ours_broken.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        ours_broken.apply_chat_template(CONVERSATIONS[0])
