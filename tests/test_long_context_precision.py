"""The defaults keep long-context quality: teacher-forced perplexity of SmolLM2 on real text, at
positions past 1,000, at this CPU class's defaults against f32 compute with an f32 cache.

On bf16 CPUs this once was 4x f32's, because RoPE angles (position * inv_freq) were computed in
bf16, which cannot hold an integer above 256 exactly (benchmarks/results/2026-11-23-zen4.md). Also: the default KV
cache precision that goes with it."""
from __future__ import annotations

import openvino as ov

from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.bench.perplexity import perplexity, text_windows
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions

WINDOW, FORCED = 1100, 48  # positions 1,052..1,099: bf16 spacing there is 8


def test_default_precision_perplexity_within_2_percent_of_f32_at_long_context():
    """On every class: where the plugin computes in f32 by default its defaults still differ from
    f32 arithmetic with an f32 cache (a u8 cache; int8 activations on VNNI CPUs)."""
    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    windows, _ = text_windows(1, WINDOW)
    f32 = perplexity(windows, WINDOW - FORCED, CompileOptions(inference_precision="f32", kv_cache_precision="f32"))
    fast = perplexity(windows, WINDOW - FORCED, CompileOptions())
    assert fast.perplexity / f32.perplexity < 1.02, (default, fast.perplexity, f32.perplexity)


def test_default_kv_cache_is_bf16_where_compute_is_bf16_and_explicit_choices_win(tmp_path):
    """The KV default departs from the plugin's u8 (measured: benchmarks/results/2026-11-23-zen4.md); an asked-for
    precision is always what the cache gets."""
    src = GGUFModel.open(write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf"))

    def key_type(options: CompileOptions) -> str:
        return compile_paged(build_model(src.config, src.tensor), options).layout.key_type.get_type_name()

    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    if default == "bf16":
        assert key_type(CompileOptions()) == "bf16"
    assert key_type(CompileOptions(kv_cache_precision="u8")) == "u8"
    assert key_type(CompileOptions(inference_precision="f32", kv_cache_precision="f32")) == "f32"
