"""A matmul kernel of our own for low-bit weights (an OpenVINO extension op).

The CPU plugin's int8-activation kernel for compressed weights is paced by unpacking, not by
memory (a 2-core Emerald Rapids: 12.9 GB/s of 4-bit weights where the cores stream 18.4). This
kernel (lowbit_matmul.cpp) quantizes the activations to int8 per group as the plugin and
llama.cpp do and reads the weights tiled so that one integer dot product covers 16 rows (8 on
AVX2), at the memory's pace (benchmarks/results/2026-11-26-emerald-rapids.md). On AMX CPUs it
takes the decode model's low-bit MatMuls (prompts keep the plugin's AMX kernels); on every other
x86-64 class every one of the single compilation's (cpu_defaults.py).
"""
from __future__ import annotations

import openvino as ov
import openvino.opset13 as ops
from openvino.utils.node_factory import NodeFactory

from vinoserve.model import fuse_projections as projections
from vinoserve.model.block_offsets import split_block_offsets
from vinoserve.model.lowbit.build import Unavailable, library
from vinoserve.model.lowbit import experts
from vinoserve.model.lowbit.rewrite import OP, replace_gathers, replace_matmuls

__all__ = ["OP", "PLANES", "Unavailable", "experts", "kernel_graph", "use_kernel"]

# The main compilation's input where it runs on the kernel: 2 (x in two int8 planes, near f32)
# where a step computes prompt tokens or one sequence decodes, 1 (llama.cpp's one plane) where
# several decode (engine/model_runner.py, ModelRunner.planes). In a step of two, some products
# take two on the rows whose logits are read only (kernel_graph's `sampled`, rewrite.COARSE).
PLANES = "lowbit_planes"


def use_kernel(model: ov.Model, core: ov.Core, planes: ov.Output | None = None, prefetch: int = 1024,
               gathers: bool = True, sampled: ov.Output | None = None, coarse: str = "gate_up") -> int:
    """In place: the model's low-bit MatMuls on the kernel, registered with `core`; x in one int8
    plane, or in as many as the scalar `planes` says and the logits' in two (the `coarse` products
    in two on the `sampled` rows only, where given: rewrite.replace_matmuls); weights prefetched
    `prefetch` bytes ahead; with `gathers`, its low-bit token table's rows read by the library's
    gather (rewrite.replace_gathers). Experts' products go to the kernel too (experts.py), in as
    many planes as x. Returns how many MatMuls and expert products; raises Unavailable (the model
    untouched) where it cannot be built or run here."""
    path = str(library())
    core.add_extension(path)  # again on the same core is harmless
    factory = NodeFactory()
    factory.add_extension(path)
    count = replace_matmuls(model, factory, planes, prefetch, sampled, coarse)
    count += experts.replace_experts(model, factory, planes, prefetch)
    if gathers:
        replace_gathers(model, factory)
    return count


def kernel_graph(model: ov.Model, core: ov.Core, fuse: bool, planes: bool = False, prefetch: int = 1024,
                 gathers: bool = True, sampled: str | None = None, coarse: str = "gate_up") -> int:
    """In place, a graph fresh from paged_attention_transformation: gate and up fused (`fuse`),
    the low-bit MatMuls on the kernel, and the block offsets of what it does not take split as
    the plugin's graph has them. With `planes`, an input PLANES (i32 scalar, 1 or 2) sets how
    many int8 planes x is quantized to each step; `sampled`: the name of the input listing the
    rows whose logits a step reads, the only ones the `coarse` products take in two planes.
    Returns how many; raises Unavailable."""
    library()  # before the graph changes: where it cannot be built, the caller keeps the plugin's
    if fuse:
        projections.fuse_projections(model, activation_inputs=True)
    scalar = None
    if planes:  # declared before the kernel's nodes read it: the model validates its parameters
        scalar = ops.parameter([], ov.Type.i32, name=PLANES)
        scalar.output(0).set_names({PLANES})
        model.add_parameters([scalar])
    rows = next((p.output(0) for p in model.get_parameters() if sampled and sampled in p.output(0).get_names()), None)
    count = use_kernel(model, core, None if scalar is None else scalar.output(0), prefetch, gathers, rows, coarse)
    if scalar is not None and not count:
        model.remove_parameter(scalar)
    split_block_offsets(model)
    return count
