"""Compute precisions that cannot serve on the CPU plugin, refused before anything is loaded."""
from __future__ import annotations

import openvino as ov

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.compile_options import CompileOptions


def check_inference_precision(options: CompileOptions, core: ov.Core | None = None) -> None:
    """f16 on CPU is wrong or not f16 at all, so it is refused (benchmarks/results/2026-11-23-zen4.md, "f16 compute"):
    - where the CPU computes f16 natively (AVX512-FP16: Sapphire Rapids and later), the plugin's
      PagedAttention gives NaN or garbage for every step that carries more than one token of a
      sequence (a prompt chunk, a speculative verify), and the KV it writes poisons later decodes;
    - elsewhere the plugin ignores the hint and runs its default (bf16 or f32), which the request
      for f16 would hide."""
    if options.inference_precision != "f16" or options.device != "CPU":
        return
    core = core or ov.Core()
    default = core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    alternatives = "use bf16 or f32" if default == "bf16" else "use f32 (this CPU has no bf16 either)"
    if "FP16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        reason = (f"OpenVINO {ov.get_version().split('-')[0]}'s CPU PagedAttention computes prompts wrongly at "
                  f"f16 on this CPU (NaN logits)")
    else:
        reason = f"this CPU has no f16 arithmetic, so OpenVINO would run {default} instead"
    raise ModelLoadError(f"--inference-precision f16 is not supported on CPU: {reason}; {alternatives} "
                         f"(or leave it out: {default} here)")
