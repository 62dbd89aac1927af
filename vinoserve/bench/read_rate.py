"""The decode bound: what a one-token step must read (the weights), over what this machine reads
a second. A single stream's decode reads every layer's matrices and the output head once a
token, so bytes / read rate is the least time a step can take on this machine (the KV cache and
the host's work come on top).

The read rate is OpenVINO's own: a ReduceMax of each of 1,024 rows of 1 MiB (1 GiB of f32) on the
CPU plugin, at the thread count the engines run with, best of a few passes: its kernels stream
each row once, as a decode step streams its weights (within 6% of a C loop of AVX2 loads over 4 GiB
on a 2-core Xeon; other shapes of the reduction are compute-bound).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.gguf_file import field, open_gguf

_READ_BYTES = 1 << 30
_PASSES = 5
_ROWS = 1024


def read_rate_gbs(threads: int | None = None) -> float:
    """GB/s a ReduceMax over 1 GiB reads at `threads` (default: the plugin's), best of 5 passes."""
    shape = [_ROWS, _READ_BYTES // 4 // _ROWS]
    x = ops.parameter(shape, ov.Type.f32)
    model = ov.Model([ops.reduce_max(x, ops.constant(np.array([1], np.int64)), keep_dims=False)], [x])
    config = {"INFERENCE_NUM_THREADS": threads} if threads else {}
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
    data = ov.Tensor(np.ones(shape, np.float32))
    best = float("inf")
    for _ in range(_PASSES + 1):  # the first pass warms up
        start = time.perf_counter()
        request.infer([data])
        best = min(best, time.perf_counter() - start)
    return _READ_BYTES / best / 1e9


def decode_step_bytes(gguf: Path) -> float:
    """Bytes of weights a one-token step reads: every tensor but the token table, which a step
    reads one row of (unless the output head is the token table, tied); of a mixture of experts'
    expert tensors (`*_exps`), the share of the experts a token is routed to."""
    reader = open_gguf(gguf)
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    arch = field(reader, "general.architecture", "")
    routed = field(reader, f"{arch}.expert_used_count", 1) / field(reader, f"{arch}.expert_count", 1)
    tied = "output.weight" not in tensors
    return sum(n * (routed if name.endswith("_exps.weight") else 1) for name, n in tensors.items()
               if tied or name != "token_embd.weight")


def bound_line(gguf: Path, rate_gbs: float, step_ms: dict[str, float]) -> str:
    """One report line: the bound, and each engine's decode step as a multiple of it."""
    nbytes = decode_step_bytes(gguf)
    bound_ms = nbytes / rate_gbs / 1e6
    return (f"decode bound: {nbytes / 1e9:.3f} GB of weights a token / {rate_gbs:.1f} GB/s read "
            f"(ReduceMax over 1 GiB) = {bound_ms:.2f} ms; a step: "
            + ", ".join(f"{name} {ms:.2f} ms ({ms / bound_ms:.2f}x)" for name, ms in step_ms.items()))
