"""A matmul kernel of our own for the decode model's low-bit weights (an OpenVINO extension op).

Measured on a 2-core Emerald Rapids (lab notes, 2026-11-27): the CPU plugin's int8-activation
kernel multiplies a one-token step's 4-bit weights at about 48 ps a weight, some 12.9 GB/s,
while the two cores stream 18.4 GB/s from memory; unpacking, not memory, sets its pace. This
kernel (lowbit_matmul.cpp) quantizes the activations to int8 per group as the plugin and
llama.cpp do, reads the weights tiled so that one VNNI dot product covers 16 rows, and runs at
32-34 ps a Q4_0 weight. It is bound by latency more than by bytes (a 1.5B Q4_K_M step took the
same time reading its scales as f32 products as reading them a third the size): two chains of
dot products and a software prefetch made a step 0.8-0.9x the time. It replaces the decode
model's low-bit MatMuls only; prompts keep the plugin's kernels (AMX).
"""
from __future__ import annotations

import openvino as ov
from openvino.utils.node_factory import NodeFactory

from vinoserve.model.lowbit.build import Unavailable, library
from vinoserve.model.lowbit.rewrite import OP, replace_matmuls

__all__ = ["OP", "Unavailable", "use_kernel"]


def use_kernel(model: ov.Model, core: ov.Core) -> int:
    """In place: the model's low-bit MatMuls on the kernel, registered with `core`. Returns how
    many; raises Unavailable (the model untouched) where it cannot be built or run here."""
    path = str(library())
    core.add_extension(path)  # again on the same core is harmless
    factory = NodeFactory()
    factory.add_extension(path)
    return replace_matmuls(model, factory)
