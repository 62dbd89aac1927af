"""Text -> token ids for encoders, with Hugging Face's `tokenizers` (Rust, no torch): the same
library sentence-transformers tokenizes with, so ids match it exactly. Truncation is ours, per
request: the file's own padding and truncation settings (often a fixed 128) are dropped."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from vinoserve.model.errors import ModelLoadError


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    type_ids: list[int]


class TooLong(ValueError):
    """Input `index` has `length` tokens (special tokens included), over the model's `limit`."""

    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"{length} tokens, over the model's limit of {limit}")
        self.index, self.length, self.limit = index, length, limit


class EncoderTokenizer:
    """Thread-safe: truncation is a setting of the Rust tokenizer, changed and used under a lock."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self._lock = threading.Lock()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: Path) -> EncoderTokenizer:
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (a fast tokenizer: save it with transformers' "
                                 f"AutoTokenizer.from_pretrained(...).save_pretrained)")
        try:
            return cls(Tokenizer.from_file(str(path / "tokenizer.json")))
        except Exception as e:  # the Rust side raises plain Exceptions for a malformed file
            raise ModelLoadError(f"{path}/tokenizer.json cannot be loaded: {e}") from e

    def save(self, path: Path) -> None:
        self._tok.save(str(path))

    def encode(self, texts: list[str] | list[tuple[str, str]], limit: int, truncate: bool) -> list[Encoded]:
        """Texts, or (a, b) pairs for a cross-encoder ([CLS] a [SEP] b [SEP] with token types),
        with the model's special tokens. Over `limit` tokens: cut to it when `truncate` (pairs
        longest first, as transformers does, special tokens kept), else TooLong for the first."""
        with self._lock:
            if truncate:
                self._tok.enable_truncation(limit, strategy="longest_first")
            try:
                done = self._tok.encode_batch(texts)
            finally:
                self._tok.no_truncation()
        out = [Encoded(e.ids, e.type_ids) for e in done]
        for i, e in enumerate(out):
            if len(e.ids) > limit:
                raise TooLong(i, len(e.ids), limit)
        return out

    def cut(self, texts: list[str], max_tokens: int) -> list[str]:
        """Each text cut after its first `max_tokens` tokens (by the tokens' character offsets),
        for a per-document cap such as Cohere's max_tokens_per_doc."""
        with self._lock:
            done = self._tok.encode_batch(texts, add_special_tokens=False)
        return [t if len(e.ids) <= max_tokens else t[:e.offsets[max_tokens - 1][1]] for t, e in zip(texts, done)]
