"""Text of one request as it grows: incremental detokenization plus stop strings, which may
straddle token boundaries and must never reach the client."""
from __future__ import annotations

from vinoserve.engine.detokenize import IncrementalDetokenizer
from vinoserve.model.tokenizer import Tokenizer


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        # Text that could still be the start of a stop string is held back until decided.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stop_string: str | None = None  # the stop string that ended the text, once one has

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_id: int) -> str:
        """Text safe to emit after `token_id`; sets `stopped` when a stop string completed."""
        self._pending += self._detok.add(token_id)
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        hits = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            cut, self.stop_string = min(hits)
            out, self._pending = self._pending[:cut], ""
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of a request that did not stop on a string, the held-back tail is text."""
        if self.stopped:
            return ""
        out, self._pending = self._pending + self._detok.flush(), ""
        return out
