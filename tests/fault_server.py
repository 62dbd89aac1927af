"""`vinoserve serve` with faults injected, for tests: run as a script with serve's flags.

A request whose stop strings include "BOOM" fails in its detokenisation (a per-request fault);
a request with seed 13 makes a whole engine step raise (a fault that breaks the engine)."""
from __future__ import annotations

import sys

from vinoserve.engine import llm_engine, text_output

_add = text_output.TextOutput.add


def _faulty_add(self, token_id: int) -> str:
    if "BOOM" in self._stop:
        raise UnicodeError("injected detokenisation fault")
    return _add(self, token_id)


_step = llm_engine.LLMEngine.step


def _faulty_step(self):
    if any(r.seq.params.seed == 13 for r in self._requests.values()):
        raise RuntimeError("injected engine fault")
    return _step(self)


text_output.TextOutput.add = _faulty_add
llm_engine.LLMEngine.step = _faulty_step

if __name__ == "__main__":
    from vinoserve.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
