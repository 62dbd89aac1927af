"""The mixture-of-experts block (model/moe.py, Weights.experts): the router and the expert products
against numpy for each gating and routing key, and the compiled graph's products on the plugin's
GatherMatmul with experts of every kept type compressed. The families built on it:
test_moe_families.py."""
from __future__ import annotations

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from gguf_fixtures import quantize
from vinoserve.model import moe
from vinoserve.model.config import ExpertRouting, Gating
from vinoserve.model.gguf_file import GGUFTensor
from vinoserve.model.weights import Weights

T = gguf.GGMLQuantizationType
EXPERTS, USED, HIDDEN, FFN = 8, 3, 256, 256  # K-quants take rows of 256

def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _reference(x: np.ndarray, router: np.ndarray, routing: ExpertRouting, gate, up, down) -> np.ndarray:
    """llama.cpp's build_moe_ffn in numpy, float64."""
    logits = x @ router.T
    out = np.zeros_like(x)
    for t in range(len(x)):
        if routing.gating == Gating.SIGMOID:
            probs = 1 / (1 + np.exp(-logits[t]))
        else:
            probs = np.exp(logits[t] - logits[t].max())
            probs /= probs.sum()
        picked = np.argsort(-probs, kind="stable")[:routing.used]
        w = probs[picked]
        if routing.gating == Gating.SOFTMAX_SELECTED:
            w = np.exp(logits[t, picked] - logits[t, picked].max())
            w /= w.sum()
        if routing.normalize:
            w = w / w.sum()
        for e, we in zip(picked, w * routing.scale):
            out[t] += we * (down[e] @ (_silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    return out


def _compiled(routing: ExpertRouting, router: np.ndarray, experts: list[moe.ExpertMatrices]) -> ov.CompiledModel:
    x = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="x")
    y = moe.expert_ffn(x, router, routing, *experts, "silu")
    return ov.Core().compile_model(ov.Model([ops.result(y)], [x]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def _experts_tensor(name: str, values: np.ndarray, qtype: T) -> GGUFTensor:
    """[E, N, K] values as a GGUF file holds them in `qtype` (rows of blocks, as GGUFMeta reads them)."""
    if qtype in (T.F32, T.F16):
        data = values.astype(np.float32 if qtype == T.F32 else np.float16).reshape(values.shape[0], -1)
    else:
        data = quantize(values, qtype).reshape(values.shape[0], -1)
    return GGUFTensor(name, qtype, data, values.shape)


def _random_experts(rng, qtype: T) -> tuple[list[GGUFTensor], list[np.ndarray]]:
    """gate, up, down as file tensors, and the values they hold (float64)."""
    shapes = {"gate": (EXPERTS, FFN, HIDDEN), "up": (EXPERTS, FFN, HIDDEN), "down": (EXPERTS, HIDDEN, FFN)}
    tensors = [_experts_tensor(f"ffn_{n}_exps", (rng.standard_normal(s) * 0.1).astype(np.float32), qtype)
               for n, s in shapes.items()]
    return tensors, [t.dequantize().astype(np.float64) for t in tensors]


@pytest.mark.parametrize("routing", [
    ExpertRouting(EXPERTS, USED),
    ExpertRouting(EXPERTS, USED, normalize=True),
    ExpertRouting(EXPERTS, 2, Gating.SIGMOID, normalize=True, scale=2.5),
    ExpertRouting(EXPERTS, USED, Gating.SOFTMAX_SELECTED),
    ExpertRouting(EXPERTS, 1),
], ids=["softmax", "softmax-norm", "sigmoid-norm-scale", "softmax-selected", "top1"])
def test_each_gating_routes_and_weighs_as_llama_cpp(routing):
    """Tokens of two sequences (some experts get no row, some several): equal to numpy's."""
    rng = np.random.default_rng(0)
    tensors, values = _random_experts(rng, T.F32)
    router = (rng.standard_normal((EXPERTS, HIDDEN)) * 0.1).astype(np.float32)
    x = rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)
    got = _compiled(routing, router, [Weights("f32").experts(t, t.name) for t in tensors])(x)[0]
    want = _reference(x.reshape(-1, HIDDEN).astype(np.float64), router.astype(np.float64), routing, *values)
    np.testing.assert_allclose(got.reshape(-1, HIDDEN), want, rtol=0, atol=2e-5)


class _Meta:
    """The GGUF keys Decoder.expert_routing reads, without a file."""

    path, architecture = "m.gguf", "olmoe"

    def __init__(self, **keys) -> None:
        self.keys = keys

    def key(self, name: str, default=None):
        return self.keys.get(name, default)


def test_routing_keys_win_over_the_familys_defaults_and_zero_is_unset():
    from vinoserve.model.architectures.olmoe import Olmoe
    from vinoserve.model.architectures.qwen3moe import Qwen3Moe
    from vinoserve.model.errors import ModelLoadError

    assert Olmoe.expert_routing(_Meta()) is None  # no expert_count: a dense FFN
    assert Qwen3Moe.expert_routing(_Meta(expert_count=8, expert_used_count=2)) == ExpertRouting(8, 2, normalize=True)
    assert Olmoe.expert_routing(_Meta(expert_count=8, expert_used_count=2)) == ExpertRouting(8, 2)
    keys = dict(expert_count=8, expert_used_count=2, expert_gating_func=2, expert_weights_norm=False,
                expert_weights_scale=2.5)
    assert Qwen3Moe.expert_routing(_Meta(**keys)) == ExpertRouting(8, 2, Gating.SIGMOID, False, 2.5)
    zeros = dict(expert_count=8, expert_used_count=2, expert_gating_func=0, expert_weights_scale=0.0)
    assert Olmoe.expert_routing(_Meta(**zeros)) == ExpertRouting(8, 2)
    with pytest.raises(ModelLoadError, match="expert_gating_func 7 is not one vinoserve knows"):
        Olmoe.expert_routing(_Meta(expert_count=8, expert_used_count=2, expert_gating_func=7))
    with pytest.raises(ModelLoadError, match="expert_used_count is missing"):
        Olmoe.expert_routing(_Meta(expert_count=8))
    with pytest.raises(ValueError, match="9 experts used a token out of 8"):
        Olmoe.expert_routing(_Meta(expert_count=8, expert_used_count=9))


# What each file type's experts are kept as in the compiled model (f16 is widened at f32 compute).
KEPT = {T.F32: "f32", T.F16: "f32", T.Q8_0: "i8", T.Q4_0: "i4", T.Q4_K: "i4", T.Q4_1: "i4", T.Q5_0: "i8",
        T.Q5_1: "i8", T.Q5_K: "i8", T.Q6_K: "i8", T.MXFP4: "i8"}
WITH_MIN = (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K)  # a minimum per block: a second product each


@pytest.mark.parametrize("qtype", list(KEPT), ids=lambda t: t.name)
def test_expert_products_run_on_gathermatmul_with_experts_kept_compressed(qtype):
    """Every expert product is one GatherMatmul reading the file's integers (a block minimum as a
    second, small product of group sums), and the result equals numpy's on the file's values."""
    rng = np.random.default_rng(1)
    tensors, values = _random_experts(rng, qtype)
    router = (rng.standard_normal((EXPERTS, HIDDEN)) * 0.1).astype(np.float32)
    routing = ExpertRouting(EXPERTS, USED, normalize=True)
    fmt = "f32" if qtype == T.F32 else "auto"  # `auto` keeps float files as f16
    compiled = _compiled(routing, router, [Weights(fmt).experts(t, t.name) for t in tensors])
    runtime = compiled.get_runtime_model().get_ordered_ops()
    gathered = [n for n in runtime if n.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
    assert len(gathered) == (6 if qtype in WITH_MIN else 3)
    kept = {n.input(1).get_source_output().get_node().get_rt_info()["outputPrecisions"].astype(str)
            for n in gathered}
    assert KEPT[qtype] in kept
    assert sum(n.get_rt_info()["layerType"].astype(str) == "FullyConnected" for n in runtime) == 1  # the router
    x = rng.standard_normal((1, 7, HIDDEN)).astype(np.float32)
    want = _reference(x[0].astype(np.float64), router.astype(np.float64), routing, *values)
    np.testing.assert_allclose(compiled(x)[0][0], want, rtol=0, atol=5e-5)


@pytest.mark.parametrize("fmt, qtype, kept", [("int4", T.Q4_0, "i4"), ("int8", T.Q8_0, "i8")])
def test_int4_and_int8_formats_requantize_float_experts(fmt, qtype, kept):
    """`--weight-format int4` / `int8` on an f16 file: the experts as Q4_0 / Q8_0 blocks of their
    values, compressed on GatherMatmul, equal to numpy on those blocks' values."""
    rng = np.random.default_rng(2)
    tensors, _ = _random_experts(rng, T.F16)
    requantized = [_experts_tensor(t.name, t.dequantize(), qtype).dequantize().astype(np.float64) for t in tensors]
    router = (rng.standard_normal((EXPERTS, HIDDEN)) * 0.1).astype(np.float32)
    routing = ExpertRouting(EXPERTS, USED)
    compiled = _compiled(routing, router, [Weights(fmt).experts(t, t.name) for t in tensors])
    gathered = [n for n in compiled.get_runtime_model().get_ordered_ops()
                if n.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
    assert {n.input(1).get_source_output().get_node().get_rt_info()["outputPrecisions"].astype(str)
            for n in gathered} == {kept}
    x = rng.standard_normal((1, 7, HIDDEN)).astype(np.float32)
    want = _reference(x[0].astype(np.float64), router.astype(np.float64), routing, *requantized)
    np.testing.assert_allclose(compiled(x)[0][0], want, rtol=0, atol=5e-5)
