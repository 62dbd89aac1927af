"""Run as a script under one kernel path ($VINOSERVE_LOWBIT_ISA): every weight layout's products
for batches of rows the paths take differently (one row, a few decoding, a prompt's blocks), in
one and two planes, saved to the .npz named on the command line (test_lowbit_paths.py)."""
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from test_lowbit_kernel import _matmul
from vinoserve.model import lowbit

LAYOUTS = {  # element, group, scale type, offset type, bits
    "q4_0": (ov.Type.i4, 32, np.float16, None, None),
    "q4_1": (ov.Type.i4, 32, np.float32, np.float32, None),
    "q4_k": (ov.Type.i4, 32, "k6", "k", None),
    "q5_k": (ov.Type.i8, 32, "k6", "k", 5),
    "q6_k": (ov.Type.i8, 16, "k", None, 6),
    "q6_32": (ov.Type.i8, 32, np.float16, None, 6),
    "q8_0": (ov.Type.i8, 32, np.float16, None, None),
    "q8_k": (ov.Type.i8, 16, "k", None, None),
    "u4": (ov.Type.u4, 16, np.float16, np.float16, None),
    "u8": (ov.Type.u8, 32, np.float16, np.float16, None),
    "mxfp4": (ov.Type.i8, 32, np.float32, None, "e2m1"),
}


def main(out: str) -> None:
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((23, 512)) * rng.random((23, 1)) * 4).astype(np.float32)
    x[5] = 0
    x[6, :64] = np.float32(1e-3) * np.arange(64)  # exact ties in the second plane's rounding
    results = {}
    core = ov.Core()
    for name, (element, group, scale, offset, bits) in LAYOUTS.items():
        model, _, _ = _matmul(200, 512, group, element, scale, offset, np.random.default_rng(3), bits)
        planes = ops.parameter([], ov.Type.i32)
        model = ov.Model([ops.add(model.get_results()[0].input_value(0), ops.constant(np.float32(0))).output(0)],
                         [*model.get_parameters(), planes])
        assert lowbit.use_kernel(model, core, planes.output(0)) == 1
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        for rows in (1, 2, 3, 7, 8, 15, 23):
            for count in (1, 2):
                results[f"{name}-{rows}-{count}"] = compiled([x[:rows], np.array(count, np.int32)])[0]
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
