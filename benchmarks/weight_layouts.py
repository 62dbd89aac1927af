"""Which compressed-weight layouts the CPU plugin multiplies fast: a stack of FullyConnected pairs.

Each layout builds the same graph: --pairs x (hidden -> intermediate -> hidden) MatMuls at a 1.5B
model's MLP shape, every weight Constant -> Convert -> [Subtract zero point] -> Multiply(scale) ->
Reshape -> MatMul with random integers, groups of 32, f16 scales. Every round calls each compiled
stack once at one token (5 calls) and once at 256, in an order that reverses each round; the
median wall and process CPU time per call are printed.

    python benchmarks/weight_layouts.py                           # bf16 compute (the plugin's default here)
    python benchmarks/weight_layouts.py --precision f32           # with the plugin's dynamic quantization
    python benchmarks/weight_layouts.py --precision f32 --dq 0    # plain f32
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

HIDDEN, INTERMEDIATE, GROUP = 1536, 8960, 32
LAYOUTS = ("i4", "u4", "u4-scalar-zp", "i4+min-correction", "i8", "u8-row-zp", "u4-f16-zp", "i4-f16-zp",
           "u4-u4-zp", "u4-u8-zp", "f16")
# Not in the default set: `-f32-scale` after i4/u4/i8 (as in "u4-f32-scale+min-correction", Q4_K
# as `auto` keeps it) makes the scales and the min correction's offsets f32 constants, and the
# decompression f32 throughout.


class Builder:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.keep: list[np.ndarray] = []  # a Constant made from an ov.Tensor views these bytes

    def _u4_or_i4(self, element: ov.Type, data: np.ndarray, shape: list[int]) -> ov.Node:
        self.keep.append(data)
        return ops.constant(ov.Tensor(data, ov.Shape(shape), element))

    def _packed(self, element: ov.Type, shape: list[int]) -> ov.Node:
        count = int(np.prod(shape)) // 2
        return self._u4_or_i4(element, self.rng.integers(0, 256, size=count, dtype=np.uint8), shape)

    def weight(self, layout: str, rows: int, cols: int) -> ov.Output:
        if layout == "f16":
            return ops.convert(ops.constant(self.rng.standard_normal((rows, cols), np.float32).astype(np.float16)),
                               ov.Type.f32).output(0)
        groups = cols // GROUP
        wide = "-f32-scale" in layout
        layout = layout.replace("-f32-scale", "")
        scale = (self.rng.random((rows, groups, 1), np.float32) * 0.01 + 0.001).astype(np.float32 if wide else np.float16)
        scale = ops.constant(scale)
        dtype = ov.Type.f32 if wide else ov.Type.f16
        if layout == "u8-row-zp":
            q = ops.constant(self.rng.integers(0, 256, (rows, cols), dtype=np.uint8))
            zp = ops.constant(self.rng.integers(100, 150, (rows, 1), dtype=np.uint8))
            s = ops.constant((self.rng.random((rows, 1), np.float32) * 0.001).astype(np.float16))
            x = ops.multiply(ops.subtract(ops.convert(q, ov.Type.f16), ops.convert(zp, ov.Type.f16)), s)
            return ops.convert(x, ov.Type.f32).output(0)
        if layout == "i8":
            q = ops.convert(ops.constant(self.rng.integers(-128, 128, (rows, groups, GROUP), dtype=np.int8)), dtype)
        else:
            q = ops.convert(self._packed(ov.Type.i4 if layout.startswith("i4") else ov.Type.u4, [rows, groups, GROUP]),
                            dtype)
        zp = self._zero_point(layout, rows, groups)
        x = ops.multiply(q if zp is None else ops.subtract(q, zp), scale)
        x = ops.reshape(x, ops.constant(np.array([rows, cols], dtype=np.int64)), special_zero=False)
        return ops.convert(x, ov.Type.f32).output(0)

    def _zero_point(self, layout: str, rows: int, groups: int) -> ov.Output | None:
        if layout == "u4-scalar-zp":
            zp = self._u4_or_i4(ov.Type.u4, np.array([8], dtype=np.uint8), [1])
        elif layout == "u4-u4-zp":
            zp = self._packed(ov.Type.u4, [rows, groups, 1])
        elif layout == "u4-u8-zp":
            zp = ops.constant(self.rng.integers(0, 16, (rows, groups, 1), dtype=np.uint8))
        elif layout == "u4-f16-zp":
            return ops.constant((self.rng.random((rows, groups, 1), np.float32) * 15).astype(np.float16)).output(0)
        elif layout == "i4-f16-zp":  # Q4_K's minimum as a zero point: -min / scale, centred, any sign
            return ops.constant(((self.rng.random((rows, groups, 1), np.float32) - 0.5) * 15).astype(np.float16)).output(0)
        else:
            return None
        return ops.convert(zp, ov.Type.f16).output(0)

    def linear(self, x: ov.Output, layout: str, rows: int, cols: int) -> ov.Output:
        base = layout.removesuffix("+min-correction")
        y = ops.matmul(x, self.weight(base, rows, cols), False, True)
        if layout.endswith("+min-correction"):  # what block_offsets.py adds for a block's min
            sums = ops.reduce_sum(ops.reshape(x, ops.constant(np.array([0, 0, cols // GROUP, GROUP])), special_zero=True),
                                  ops.constant(np.array([-1])), False)
            offsets = (self.rng.random((rows, cols // GROUP)) * 0.01).astype(np.float16)
            offsets = ops.convert(ops.constant(offsets.astype(np.float32) if "-f32-scale" in layout else offsets),
                                  ov.Type.f32)
            y = ops.add(y, ops.matmul(sums, offsets, False, True))
        return y.output(0)

    def model(self, layout: str, pairs: int) -> ov.Model:
        p = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="x")
        x = p.output(0)
        for _ in range(pairs):
            h = ops.multiply(self.linear(x, layout, INTERMEDIATE, HIDDEN), ops.constant(np.float32(0.01)))
            x = ops.add(x, ops.multiply(self.linear(h.output(0), layout, HIDDEN, INTERMEDIATE),
                                        ops.constant(np.float32(0.01)))).output(0)
        return ov.Model([x], [p])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--dq", default=None, help="DYNAMIC_QUANTIZATION_GROUP_SIZE (default: the plugin's)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    props = {"NUM_STREAMS": "1", "INFERENCE_PRECISION_HINT": args.precision}
    if args.dq is not None:
        props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = args.dq
    builder, core = Builder(), ov.Core()
    layouts = args.layouts.split(",")
    requests = {name: core.compile_model(builder.model(name, args.pairs), "CPU", props).create_infer_request()
                for name in layouts}
    one = np.random.default_rng(1).standard_normal((1, 1, HIDDEN), np.float32)
    many = np.random.default_rng(1).standard_normal((1, 256, HIDDEN), np.float32)
    times = {name: {k: [] for k in ("1 wall", "1 cpu", "256 wall", "256 cpu")} for name in layouts}
    for r in requests.values():
        r.infer({0: one})
        r.infer({0: many})
    for i in range(args.rounds):
        for name in layouts if i % 2 == 0 else layouts[::-1]:
            for tokens, x, calls in (("1", one, 5), ("256", many, 1)):
                w, c = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    requests[name].infer({0: x})
                times[name][f"{tokens} wall"].append((time.perf_counter() - w) / calls * 1e3)
                times[name][f"{tokens} cpu"].append((time.process_time() - c) / calls * 1e3)
    print(f"{args.pairs} pairs of {HIDDEN}x{INTERMEDIATE} FullyConnected, {args.precision} compute, "
          f"{args.rounds} rounds; median ms per call")
    print(f"{'layout':<20}{'1 token wall':>14}{'cpu':>9}{'256 tokens wall':>17}{'cpu':>9}")
    for name in layouts:
        t = {k: statistics.median(v) for k, v in times[name].items()}
        print(f"{name:<20}{t['1 wall']:>14.2f}{t['1 cpu']:>9.2f}{t['256 wall']:>17.1f}{t['256 cpu']:>9.1f}")


if __name__ == "__main__":
    main()
