"""Two forms of one mixture-of-experts layer at OLMoE-1B-7B's size (hidden 2,048, 64 experts of
1,024, top 8), experts as i4 groups of 32 with f16 scales, timed per step size (issue 57's prompt
and many-stream paths):

  grouped  vinoserve's today (model/moe.py expert_ffn): GroupedMatMul over the (token, expert)
           pairs, which the CPU plugin runs as GatherMatmul, reading only routed experts;
  dense    every token through every expert as two FullyConnected layers over all experts' rows
           (gate and up [E * I, H]; down [H, E * I] with the routing weights applied to the
           activations first, zero for experts not picked: exact by linearity), E / k times the
           products but on the plugin's ordinary compressed-weight kernels.

    python benchmarks/moe_forms.py f32     # or bf16 (the inference precision)
"""
import sys
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.blocks import const
from vinoserve.model.config import ExpertRouting, Gating
from vinoserve.model.moe import ExpertMatrices, expert_ffn, route

H, I, E, K = 2048, 1024, 64, 8
rng = np.random.default_rng(0)  # weights and inputs
routing = ExpertRouting(E, K, Gating.SOFTMAX, False, 1.0)
router = rng.standard_normal((E, H)).astype(np.float32) * 0.02

def compressed(rows: int, cols: int, lead: tuple[int, ...] = ()) -> ov.Output:
    q = rng.integers(-8, 8, (*lead, rows, cols // 32, 32)).astype(np.int8)
    s = (rng.random((*lead, rows, cols // 32, 1)) * 0.01).astype(np.float16)
    w = ops.multiply(ops.convert(ops.constant(q, ov.Type.i4), ov.Type.f16), ops.constant(s))
    return ops.convert(ops.reshape(w, const([*lead, rows, cols]), False), ov.Type.f32).output(0)

def grouped() -> ov.Model:
    x = ops.parameter([-1, H], ov.Type.f32, name="x")
    y = expert_ffn(x.output(0), router, routing, ExpertMatrices(compressed(I, H, (E,))),
                   ExpertMatrices(compressed(I, H, (E,))), ExpertMatrices(compressed(H, I, (E,))), "silu")
    return ov.Model([ops.result(y)], [x])

def dense() -> ov.Model:
    x = ops.parameter([-1, H], ov.Type.f32, name="x")
    experts, weights = route(x.output(0), router, routing)
    g = ops.matmul(x, compressed(E * I, H), False, True)
    u = ops.matmul(x, compressed(E * I, H), False, True)
    a = ops.multiply(ops.swish(g), u)  # [T, E*I]
    T = ops.gather(ops.shape_of(x), const([0]), const(0))
    dense_w = ops.scatter_elements_update(ops.broadcast(const(0.0, np.float32), ops.concat([T, const([E])], 0)),
                                          experts, weights, const(1))
    a = ops.reshape(ops.multiply(ops.reshape(a, const([0, E, I]), True), ops.unsqueeze(dense_w, const(-1))),
                    const([0, E * I]), True)
    y = ops.matmul(a, compressed(H, E * I), False, True)
    return ov.Model([ops.result(y)], [x])


def main() -> None:
    core = ov.Core()
    cfg = {"INFERENCE_NUM_THREADS": "2", "INFERENCE_PRECISION_HINT": sys.argv[1] if len(sys.argv) > 1 else "bf16"}
    for name, build in (("grouped", grouped), ("dense", dense)):
        c = core.compile_model(build(), "CPU", cfg)
        req = c.create_infer_request()
        for T in (1, 16, 64, 256, 512):
            x = rng.standard_normal((T, H)).astype(np.float32)
            req.infer({"x": x})
            n = 5 if T <= 16 else 2
            t0 = time.perf_counter()
            for _ in range(n):
                req.infer({"x": x})
            print(f"{name:8s} T={T:4d} {1e3 * (time.perf_counter() - t0) / n:8.1f} ms", flush=True)


if __name__ == "__main__":
    main()
