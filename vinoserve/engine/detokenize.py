"""Streaming detokenization: O(1) per token, never half a UTF-8 character."""
from __future__ import annotations

import codecs

from vinoserve.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Concatenates each token's bytes through an incremental UTF-8 decoder, which holds back a
    character split across byte-level tokens until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text newly completed by `token_id` ('' while a character is still incomplete)."""
        if token_id in self._skip or token_id >= len(self._bytes):
            return ""
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        """Bytes of a character the text ended in the middle of, as U+FFFD."""
        return self._utf8.decode(b"", final=True)
