"""The kernel library's token-table gather (model/lowbit/lowbit_gather.hpp): rows of a low-bit
table decompressed exactly as weights.py's chain writes them (q * scale, then + offset, in f32),
which the plugin would gather on its reference code."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from vinoserve.model import lowbit, quantized
from vinoserve.model.gguf_file import GGUFTensor
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.weights import Weights

T = gguf.GGMLQuantizationType
F32 = {"INFERENCE_PRECISION_HINT": "f32"}


def _gather_model(table: GGUFTensor, id_type: ov.Type) -> ov.Model:
    ids = ops.parameter([-1, -1], id_type)
    rows = ops.gather(Weights("auto").table(table, "tok"), ids, ops.constant(np.int64(0)))
    return ov.Model([rows.output(0)], [ids])


def _decompressed(table: GGUFTensor) -> np.ndarray:
    """The Blocks weights.py keeps, decompressed in numpy: q * scale (+ offset), f32."""
    b = quantized.unpack(table.ggml_type, table.data)
    q = b.q.astype(np.int16)
    if b.element.bitwidth == 4:  # two values a byte, the first in the low nibble
        q = np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], -1)
        q = np.where(q >= 8, q - 16, q) if b.element == ov.Type.i4 else q
    w = q.astype(np.float32) * b.scale.astype(np.float32)
    return (w if b.offset is None else w + b.offset).reshape(table.shape)


def _tables() -> list[GGUFTensor]:
    x = np.random.default_rng(0).standard_normal((300, 512)).astype(np.float32)
    made = [GGUFTensor(f"tok {t.name}", t, gguf.quants.quantize(x, t), x.shape) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)]
    q4_k_m = GGUFModel.open(Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf")
    return [*made, *(q4_k_m.meta.tensor(n) for n in ("token_embd.weight", "output.weight"))]  # Q4_K, Q6_K


@pytest.mark.parametrize("table", _tables(), ids=lambda t: t.ggml_type.name)
def test_the_gather_reads_rows_as_the_graph_decompresses_them(kernel, table):
    core = ov.Core()
    model = _gather_model(table, ov.Type.i64)
    lowbit.use_kernel(model, core)
    assert [n.get_type_name() for n in model.get_ordered_ops()].count("LowBitGather") == 1
    compiled = core.compile_model(model, "CPU", F32)
    plugin = ov.Core().compile_model(_gather_model(table, ov.Type.i64), "CPU", F32)
    rows = table.shape[0]
    for ids in (np.array([[7]]), np.random.default_rng(1).integers(0, rows, (2, 40)), np.array([[0, rows - 1]])):
        got = compiled([ids])[0]
        np.testing.assert_array_equal(got, _decompressed(table)[ids])
        np.testing.assert_array_equal(got, plugin([ids])[0])  # the plugin's own gather: the same floats


def test_the_gather_takes_i32_ids_and_refuses_ids_outside_the_table(kernel):
    table = _tables()[0]
    core = ov.Core()
    model = _gather_model(table, ov.Type.i32)
    lowbit.use_kernel(model, core)
    compiled = core.compile_model(model, "CPU", F32)
    np.testing.assert_array_equal(compiled([np.array([[3, 299]], np.int32)])[0], _decompressed(table)[[[3, 299]]])
    with pytest.raises(RuntimeError, match="token id 300 is outside the table's 300 rows"):
        compiled([np.array([[3, 300]], np.int32)])

