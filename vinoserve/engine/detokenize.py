"""Incremental detokenization that never emits half a UTF-8 character."""
from __future__ import annotations

from vinoserve.model.tokenizer import Tokenizer

# Byte-level BPE splits multi-byte characters across tokens; until the rest arrives the partial
# bytes decode to U+FFFD, which must not be streamed.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes only a short window of recent tokens per step (O(1), not O(length)); the window
    starts at the previously emitted chunk so decoders see the left context they need."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this were emitted

    def add(self, token_id: int) -> str:
        """Text newly completed by `token_id` ('' while a character is still incomplete)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self._prefix:], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]
