"""A static-shaped clone of the kernel's one compilation, for steps that compute one token (one
sequence decoding without proposals: single-stream decode).

In a graph whose token count is dynamic the CPU plugin runs each extension op (the kernel's
LowBitMatMul and LowBitGather, model/lowbit) through its fallback shape inference on every call:
it cannot tell what the op's output shape depends on, so it treats every input as data, and
each call clones the node, validates the clone and redefines the output's memory. A [16 x 1,536]
Q4_0 product took ~7 us a call so, ~1 with static shapes (Zen 5), and a 1.5B step makes 113-142
such calls. With the token count fixed at one, every node but PagedAttention (whose block tables
still vary) has static shapes. Measured on a 2-core Zen 5 (benchmarks/results/2026-11-28-zen5.md): 1.5B decode
1.100x (Q4_0) and 1.077x (Q4_K_M), paired in one process, the same tokens; the clone shares the
main compilation's constants, so it costs ~40 MiB resident and half a second of compiling (the
startup log gives the first).

Only one token: a clone per token count would pay that for each, and steps of several sequences
or of proposals are fewer and longer.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import lowbit
from vinoserve.model.blocks import ROPE_OFFSETS
from vinoserve.model.image_attention import TOKEN_TYPES
from vinoserve.model.image_inputs import IMAGE_EMBEDS, IMAGE_ROWS

TOKENS = 1
# the inputs with a row per token this step (graph_facts; paged.SAMPLED_INDICES: one row sampled)
_PER_TOKEN = ("input_ids", "position_ids", "sampled_token_indices")
# ModelRunner.planes: a step of one sequence quantizes x in two int8 planes
_PLANES = 2


def graph(model: ov.Model) -> ov.Model:
    """A clone of the kernel's compilation graph (after lowbit.kernel_graph) for steps of one token:
    its per-token inputs one row long, its planes input a constant."""
    clone = model.clone()
    planes = next((p for p in clone.get_parameters() if lowbit.PLANES in p.output(0).get_names()), None)
    if planes is not None:
        for target in list(planes.output(0).get_target_inputs()):
            target.replace_source_output(ops.constant(np.int32(_PLANES)).output(0))
        clone.remove_parameter(planes)
    names = {name for i in clone.inputs for name in i.get_names()}
    shapes = {name: ov.PartialShape([TOKENS]) for name in _PER_TOKEN if name in names}
    streams = next((i.get_partial_shape() for i in clone.inputs if "position_ids" in i.get_names()), None)
    if streams is not None and streams.rank.get_length() == 2:  # M-RoPE's three streams (an optimum Qwen-VL export)
        shapes["position_ids"] = ov.PartialShape([streams[0], TOKENS])
    if IMAGE_EMBEDS in names:  # a decode step carries no image rows (they come with prompts): none, statically
        width = next(i for i in clone.inputs if IMAGE_EMBEDS in i.get_names()).get_partial_shape()[1]
        shapes |= {IMAGE_ROWS: ov.PartialShape([0]), IMAGE_EMBEDS: ov.PartialShape([ov.Dimension(0), width])}
    if TOKEN_TYPES in names:  # nor token types: its one row is causal
        shapes[TOKEN_TYPES] = ov.PartialShape([0])
    if ROPE_OFFSETS in names:  # M-RoPE: the token's height and width offsets (0: a generated token)
        shapes[ROPE_OFFSETS] = ov.PartialShape([TOKENS, 2])
    clone.reshape(shapes)
    return clone
