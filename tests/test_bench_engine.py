"""`vinoserve bench engine`: both engines run at the precision asked for, and say which they used."""
from __future__ import annotations

import re

from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.cli import main


def test_precision_flags_reach_both_engines(tmp_path, capfd):
    gguf = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    assert main(["bench", "engine", "--model", str(gguf), "--prompts", "2", "--input-len", "16",
                 "--output-len", "4", "--inference-precision", "f32", "--kv-cache-precision", "f16"]) in (0, None)
    out = capfd.readouterr().out
    assert re.search(r"^vinoserve .*f32 inference, f16 KV\)$", out, re.M), out
    assert re.search(r"^openvino-genai .*f32 inference, f16 KV\)$", out, re.M), out
    assert re.search(r"^ratio vinoserve / genai: \d+\.\d{3}$", out, re.M), out
    assert "Model: LLM with Paged Attention" not in out  # genai's property dump stays captured
