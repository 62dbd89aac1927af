"""The kernel's products alone, per instruction-set path: one graph of `--count` distinct
[n x k] products of the same rows of x (summed, so every product runs), timed per product, each
layout's graph in turn over the rounds. Pick a path with $VINOSERVE_LOWBIT_ISA.

    VINOSERVE_LOWBIT_ISA=avx2 python benchmarks/lowbit_products.py --rows 256 --planes 1
    VINOSERVE_LOWBIT_ISA=avx512bw python benchmarks/lowbit_products.py --rows 1 --planes 2 --count 60

With --rows 1, make count x the weights' bytes larger than the CPU's last-level cache (a decode
step's weights come from memory).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_lowbit_kernel import _matmul  # the weight chains weights.py writes

from vinoserve.model import lowbit
from vinoserve.model.cpu_class import this_cpu
from vinoserve.model.cpu_defaults import DEFAULTS
from vinoserve.model.lowbit import build

LAYOUTS = {"q4_0": (ov.Type.i4, 32, np.float16, None, None), "q4_k": (ov.Type.i4, 32, "k6", "k", None),
           "q6_k": (ov.Type.i8, 16, "k", None, 6), "q8_0": (ov.Type.i8, 32, np.float16, None, None)}


def _compiled(layout: str, n: int, k: int, count: int, threads: int, prefetch: int) -> ov.InferRequest:
    x, planes = ops.parameter([-1, k], np.float32), ops.parameter([], ov.Type.i32)
    total = None
    for i in range(count):
        element, group, scale, offset, bits = LAYOUTS[layout]
        model, _, _ = _matmul(n, k, group, element, scale, offset, np.random.default_rng(i), bits)
        y = ops.matmul(x, model.get_results()[0].input_value(0).get_node().input_value(1), False, True)
        total = y if total is None else ops.add(total, y)
    model = ov.Model([total.output(0)], [x, planes])
    core = ov.Core()
    assert lowbit.use_kernel(model, core, planes.output(0), prefetch=prefetch) == count
    return core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads}) \
        .create_infer_request()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="q4_0,q4_k,q6_k", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--planes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prefetch", type=int, default=DEFAULTS[this_cpu()].lowbit_prefetch,
                    help="bytes the weights are prefetched ahead (default: this CPU class's)")
    args = ap.parse_args()
    requests = {name: _compiled(name, args.n, args.k, args.count, args.threads, args.prefetch) for name in args.layouts.split(",")}
    x = np.random.default_rng(0).standard_normal((args.rows, args.k)).astype(np.float32)
    planes = np.array(args.planes, np.int32)
    times = {name: [] for name in requests}
    for _ in range(args.rounds):
        for name, request in requests.items():
            start = time.perf_counter()
            request.infer([x, planes])
            times[name].append((time.perf_counter() - start) / args.count)
    print(f"path {build.isa().name}, [{args.n} x {args.k}] x {args.count}, {args.rows} rows, "
          f"{args.planes} plane(s), {args.threads} threads: ms a product, median (min) of {args.rounds - 1} rounds")
    for name, ts in times.items():
        print(f"  {name:6s} {1e3 * statistics.median(ts[1:]):8.3f} ({1e3 * min(ts):.3f})")


if __name__ == "__main__":
    main()
