"""`vinoserve bench engine`: both engines run at the precision and sampling asked for, and say which."""
from __future__ import annotations

import re
import subprocess
import sys

from gguf_fixtures import tiny_hf_model, write_gguf


def test_precision_and_sampling_flags_reach_both_engines(tmp_path):
    gguf = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    # A process of its own: genai's pipeline leaves threads behind in its process, and a later
    # test that forks (pexpect) can crash between fork and exec in a process that has them.
    run = subprocess.run([sys.executable, "-m", "vinoserve.cli", "bench", "engine", "--model", str(gguf),
                          "--prompts", "2", "--input-len", "16", "--output-len", "4",
                          "--inference-precision", "f32", "--kv-cache-precision", "f16", "--repeats", "2",
                          "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--repetition-penalty", "1.05"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert re.search(r"^model .*, sampled at temperature 0\.8, top_p 0\.9, top_k 20, repetition_penalty 1\.05$", out, re.M), out
    # f32 compute: the plugin never fuses projections itself then, so vinoserve does on every CPU
    assert re.search(r"^vinoserve .*f32 inference, f16 KV, q/k/v fused\)$", out, re.M), out
    assert re.search(r"^openvino-genai .*f32 inference, f16 KV\)$", out, re.M), out
    assert re.search(r"^paired ratios: \d+\.\d{3} \d+\.\d{3}$", out, re.M), out  # --repeats 2: two paired runs
    assert re.search(r"^ratio vinoserve / genai: \d+\.\d{3}$", out, re.M), out
    assert "Model: LLM with Paged Attention" not in out  # genai's property dump stays captured


def test_fresh_prompts_share_no_prefix_cache_block(smollm2_gguf):
    """`--prompts 64` used to stop on "prefix cache hit": docstrings inherited by subclasses put one
    passage into the text several times, and two evenly spaced cuts began inside two copies."""
    from vinoserve.bench.engine_vs_genai import real_text_prompts
    from vinoserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    for count in (3, 66, 194):  # the bench's --prompts 1, 64 (+2 warm-up), 64 x 3 repeats
        prompts = real_text_prompts(tokenizer, count, 256)
        assert len({tuple(p[:32]) for p in prompts}) == count and {len(p) for p in prompts} == {256}
