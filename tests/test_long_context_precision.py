"""The default precision keeps long-context quality: teacher-forced perplexity of SmolLM2 on real
text, at positions past 1,000, with the plugin's default compute precision against f32.

On bf16 CPUs this once was 4x f32's, because RoPE angles (position * inv_freq) were computed in
bf16, which cannot hold an integer above 256 exactly (see docs/performance.md)."""
from __future__ import annotations

import openvino as ov
import pytest

from vinoserve.bench.perplexity import perplexity, text_windows
from vinoserve.model.paged import CompileOptions

WINDOW, FORCED = 1100, 48  # positions 1,052..1,099: bf16 spacing there is 8


def test_default_precision_perplexity_within_2_percent_of_f32_at_long_context():
    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    if default == "f32":
        pytest.skip("this CPU computes in f32 by default (no bf16/f16 support): nothing to compare")
    windows, _ = text_windows(1, WINDOW)
    f32 = perplexity(windows, WINDOW - FORCED, CompileOptions(inference_precision="f32", kv_cache_precision="f32"))
    fast = perplexity(windows, WINDOW - FORCED, CompileOptions())
    assert fast.perplexity / f32.perplexity < 1.02, (default, fast.perplexity, f32.perplexity)
