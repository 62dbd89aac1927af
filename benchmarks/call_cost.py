"""What one product costs beyond its bytes: vinoserve's kernel (model/lowbit) against the plugin's
own MatMul, in graphs of `--count` independent products of the same x (each its own output), with
x's rows static (a one-token clone's steps) or dynamic (every other step), at each thread count.

    VINOSERVE_LOWBIT_ISA=avx2 python benchmarks/call_cost.py
    python benchmarks/call_cost.py --shapes 16x256,1536x1536 --threads 1,2,16

A [16 x 256] product is a few kB: its time is the call's fixed cost. Larger shapes are timed
too, with the time the kernel's weights (Q4_0's 4.5 bits) would take at the machine's read rate
beside them (`vinoserve.bench.read_rate`, at the same threads); the plugin's MatMul reads f32
weights, 7x those bytes, so only its small shapes compare.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_lowbit_kernel import _matmul  # the weight chains weights.py writes

from vinoserve.bench.read_rate import read_rate_gbs
from vinoserve.model import lowbit
from vinoserve.model.cpu_class import this_cpu
from vinoserve.model.cpu_defaults import DEFAULTS
from vinoserve.model.lowbit import build


def _request(n: int, k: int, count: int, rows: int | None, threads: int, kernel: bool) -> ov.InferRequest:
    """`count` Q4_0-like products [n x k] of one x ([rows, k], or [-1, k] where rows is None): on the
    kernel, or the plugin's MatMul on the same weights made f32 constants."""
    x, planes = ops.parameter([rows or -1, k], np.float32), ops.parameter([], ov.Type.i32)
    outputs = []
    for i in range(count):
        model, scaled, _ = _matmul(n, k, 32, ov.Type.i4, np.float16, None, np.random.default_rng(i))
        weights = model.get_results()[0].input_value(0).get_node().input_value(1) if kernel \
            else ops.constant(scaled.astype(np.float32)).output(0)
        outputs.append(ops.matmul(x, weights, False, True).output(0))
    model, core = ov.Model(outputs, [x, planes]), ov.Core()
    if kernel:
        assert lowbit.use_kernel(model, core, planes.output(0), prefetch=DEFAULTS[this_cpu()].lowbit_prefetch) == count
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads})
    return compiled.create_infer_request()


def _us_a_call(request: ov.InferRequest, k: int, count: int, rounds: int) -> float:
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    feed = [x, np.array(1, np.int32)]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        request.infer(feed)
        times.append((time.perf_counter() - start) / count)
    return 1e6 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x256,576x576,1536x1536", help="n x k of each product")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--count", type=int, default=64, help="products a graph")
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args()
    print(f"kernel path {build.isa().name}, one row of x, {args.count} products a graph, us a call (median of "
          f"{args.rounds - 1} rounds): ours on the kernel, the plugin's f32 MatMul, x's rows static / dynamic")
    for threads in map(int, args.threads.split(",")):
        rate = read_rate_gbs(threads)
        print(f"{threads} thread(s), read rate {rate:.1f} GB/s")
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            cells = [f"{_us_a_call(_request(n, k, args.count, rows, threads, kernel), k, args.count, args.rounds):7.1f}"
                     for kernel in (True, False) for rows in (1, None)]
            bytes_ = n * k * 18 / 32  # Q4_0's 4.5 bits a weight
            print(f"  [{n:5d} x {k:5d}] {bytes_ / 1e3:8.1f} kB ({bytes_ / rate / 1e3:6.1f} us at the read rate): "
                  f"ours {cells[0]} / {cells[1]}, plugin's {cells[2]} / {cells[3]}")


if __name__ == "__main__":
    main()
