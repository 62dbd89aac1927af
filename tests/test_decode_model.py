"""The decode model (model/decode_model.py): a second compilation for steps of few tokens, sharing
the KV cache with the main one; the runner sends each step to one of them by its token count."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model import decode_model
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import PagedModel, compile_paged
from vinoserve.model.compile_options import CompileOptions


@pytest.fixture(scope="module")
def q4_0(tmp_path_factory) -> GGUFModel:
    path = tmp_path_factory.mktemp("decode_model") / "q4_0.gguf"
    return GGUFModel.open(write_gguf(tiny_hf_model("llama"), path, quant="Q4_0"))


def _alone(model: PagedModel, which: str) -> PagedModel:
    """One of the two compilations as a model of its own (no routing)."""
    compiled = model.decode if which == "decode" else model.compiled
    return PagedModel(model.facts, compiled, model.options, model.layout)


def test_steps_go_by_token_count_and_share_the_cache(q4_0):
    """Forced on (any CPU): a prompt prefilled by the main compilation, then a one-token step, the
    same token as a prompt's and a step past the decode model's limit. Each gives exactly the logits of the compilation it belongs to, run alone
    over a copy of the cache: the one-token step read the prompt's KV the main one wrote."""
    options = CompileOptions(inference_precision="f32", decode_model=True)
    model = compile_paged(build_model(q4_0.config, q4_0.tensor, "auto"), options)
    assert model.decode is not None and model.options.kv_cache_precision == "u8"
    assert model.layout.key_type.get_type_name() == "u8"
    cache = KVCache(model.layout, q4_0.config.num_layers, num_blocks=4)
    routed = ModelRunner(model, cache, num_requests=1)
    prompt = list(range(10, 40))
    routed.step([ScheduledChunk(prompt, 0, [[0, 1]])])
    # a token just sampled, the same read in (a prompt's last: on the main compilation whatever its
    # size, as in a prompt computed whole), and a step past the decode model's limit
    for new, read_in in (([41], False), ([41], True), (list(range(41, 42 + decode_model.MAX_TOKENS)), False)):
        which = "decode" if len(new) <= decode_model.MAX_TOKENS and not read_in else "main"
        step = [ScheduledChunk(new, len(prompt), [[0, 1]], num_logits=len(new), prompt=read_in)]
        before = _copy(cache)
        got = routed.step(step).rows.copy()
        ref = ModelRunner(_alone(model, which), before, num_requests=1).step(step).rows
        np.testing.assert_array_equal(got, ref)
        empty = KVCache(model.layout, q4_0.config.num_layers, num_blocks=4)  # without the prompt's KV
        for t in empty.keys + empty.values:
            t.data[...] = 0
        assert not np.array_equal(ModelRunner(_alone(model, which), empty, num_requests=1).step(step).rows, got)


def test_the_kernel_library_outlives_the_graphs_made_from_it(tmp_path):
    """Compiling the decode model freed graphs holding the kernel's nodes after OpenVINO had
    unloaded the library they came from (the Cores and NodeFactory that loaded it gone): a
    segfault, seen with the AVX2 class's settings (benchmarks/emulate_cpu_class) in a process that
    had imported torch. The library now stays loaded for the process (lowbit/build.py)."""
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "q4_0.gguf", quant="Q4_0")
    script = ("import torch\n"  # imported first, as in the suite: without it the library stayed mapped
              "from pathlib import Path\n"
              "from vinoserve.model.compile_options import CompileOptions\n"
              "from vinoserve.model.gguf_loader import GGUFModel\n"
              "from vinoserve.model.graph import build_model\n"
              "from vinoserve.model.paged import compile_paged\n"
              f"src = GGUFModel.open(Path({str(path)!r}))\n"
              "model = compile_paged(build_model(src.config, src.tensor, 'auto'),\n"
              "                      CompileOptions(inference_precision='f32', decode_model=True))\n"
              "assert model.decode is not None\n")
    emulate = Path(__file__).resolve().parent.parent / "benchmarks" / "emulate_cpu_class"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(emulate), os.environ.get("PYTHONPATH")])),
           "VINOSERVE_EMULATE_CLASS": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def _copy(cache: KVCache) -> KVCache:
    copy = KVCache(cache.layout, len(cache.keys), cache.num_blocks)
    for dst, src in zip(copy.keys + copy.values, cache.keys + cache.values):
        dst.data[...] = src.data
    return copy


def test_decode_model_stays_off_where_it_cannot_help(q4_0, monkeypatch):
    f16 = build_model(q4_0.config, q4_0.tensor, "f16")
    assert not decode_model.has_low_bit_matmuls(f16)
    assert decode_model.has_low_bit_matmuls(build_model(q4_0.config, q4_0.tensor, "auto"))
    # f32 compute asked for is f32 arithmetic: no int8 activations anywhere
    model = compile_paged(build_model(q4_0.config, q4_0.tensor, "auto"),
                          CompileOptions(inference_precision="f32", kv_cache_precision="f32"))
    assert model.decode is None and model.options.decode_model is False
    # a packed copy above a quarter of the memory keeps it off (a server has better use for that memory)
    graph = build_model(q4_0.config, q4_0.tensor, "auto")
    assert 0 < decode_model.packed_copy_bytes(graph) < 2**24
    monkeypatch.setattr(decode_model, "MEMORY_SHARE", 0.0)
    assert not decode_model.wanted(None, graph)
    # a KV precision the two compilations cannot share keeps it off, or is refused when it is forced
    model = compile_paged(build_model(q4_0.config, q4_0.tensor, "auto"), CompileOptions(kv_cache_precision="f16"))
    assert model.decode_graph is None  # (on AVX512_BF16 the kernel compilation's one-token clone, model/one_token.py)
    with pytest.raises(ModelLoadError, match="decode model shares a u8 KV cache"):
        compile_paged(build_model(q4_0.config, q4_0.tensor, "auto"),
                      CompileOptions(kv_cache_precision="f16", decode_model=True))


def test_the_packed_copy_counts_what_the_matmuls_read(tmp_path):
    """The second copy's size (logged, and what `auto` weighs against memory): every matmul's
    integers, scales (f16 ones widened to f32) and block offsets; a token table only a Gather
    reads is not packed, a tied one is (as the LM head's)."""
    def packed(quant: str, tie: bool) -> int:
        src = GGUFModel.open(write_gguf(tiny_hf_model("llama", tie=tie), tmp_path / f"{quant}-{tie}.gguf", quant=quant))
        return decode_model.packed_copy_bytes(build_model(src.config, src.tensor, "auto"))

    # Q4_1 holds the same 4-bit integers as Q4_0 plus an f32 offset per block: more bytes packed
    assert packed("Q4_1", False) > packed("Q4_0", False) > 0
    # untied: the table is gathered in place and the LM head packed; tied: the table is the LM head
    assert packed("Q4_1", True) == packed("Q4_1", False)


@pytest.mark.parametrize("flag,value", [("auto", None), ("on", True), ("off", False)])
def test_the_flag_reaches_the_compile_options(flag, value):
    from vinoserve.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--decode-model", flag])
    assert _engine_config(args).compile.decode_model is value


def test_every_compilation_keeps_a_bounded_shape_cache(tmp_path, monkeypatch):
    """The plugin's kernels per input shape: at its default of 5,000 a server's memory grew with
    every new step size for thousands of requests (docs/reliability.md). Each of the engine's
    compilations (main, decode model or one-token clone, per this CPU's defaults) keeps 256."""
    import openvino as ov

    from vinoserve.engine.llm_engine import EngineConfig, LLMEngine

    asked, compile_model = [], ov.Core.compile_model

    def recorded(core, model, device="CPU", properties=None):
        if any(op.get_type_name() == "PagedAttentionExtension" for op in model.get_ops()):  # not the tokenizer's
            asked.append((properties or {}).get("CPU_RUNTIME_CACHE_CAPACITY"))
        return compile_model(core, model, device, properties or {})

    monkeypatch.setattr(ov.Core, "compile_model", recorded)
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "q4.gguf", quant="Q4_0")
    paged = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16), log=lambda m: None).model.paged
    assert len(asked) == 1 + (paged.decode is not None) and set(asked) == {"256"}
