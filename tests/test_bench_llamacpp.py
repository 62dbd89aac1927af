"""`vinoserve bench llamacpp`: llama.cpp and vinoserve run the same GGUF's prompt, and the figures print."""
from __future__ import annotations

import re
import subprocess
import sys

import gguf
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf

pytest.importorskip("xllamacpp", reason="the llama.cpp comparison needs the bench extra (xllamacpp)")


@pytest.mark.parametrize("order", [[], ["--one-at-a-time"]])
def test_same_prompt_through_both_engines(order, tmp_path, monkeypatch):
    """Paired rounds, or each engine started, timed and closed in turn (models too large for two)."""
    # llama.cpp rejects the fixture's 'gpt2' pre-tokenizer name; 'smollm' is the real model's.
    add_pre = gguf.GGUFWriter.add_tokenizer_pre
    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", lambda self, pre: add_pre(self, "smollm"))
    model = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    run = subprocess.run([sys.executable, "-m", "vinoserve.cli", "bench", "llamacpp", "--model", str(model),
                          "--weight-formats", "f32", "--input-len", "24", "--output-len", "6", "--rounds", "2", *order],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert ("one engine at a time" in out) == bool(order), out
    rows = {m[1]: m for m in re.finditer(r"^(llama\.cpp|vinoserve f32) +(\d+\.\d) +(\d+\.\d) +(\d+\.\d)(.*)$",
                                         out, re.M)}
    assert set(rows) == {"llama.cpp", "vinoserve f32"}, out
    assert all(float(rows[n][2]) > 0 and float(rows[n][3]) > 0 for n in rows), out
    assert re.fullmatch(r" +\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\] +\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\]",
                        rows["vinoserve f32"][5]), out
    cpu = {m[1]: m for m in re.finditer(r"^(llama\.cpp|vinoserve f32) +(\d+\.\d\d) +(\d+\.\d\d) +(.*)$", out, re.M)}
    assert set(cpu) == {"llama.cpp", "vinoserve f32"} and all(float(cpu[n][2]) > 0 for n in cpu), out  # CPU ms a token
    assert re.fullmatch(r"\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\] +\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\]",
                        cpu["vinoserve f32"][4]), out
    assert re.search(r"^llama\.cpp's own timings \(median\): decode \d+\.\d tok/s, prompt \d+\.\d tok/s$", out, re.M)
