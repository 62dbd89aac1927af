"""Image rows into a PagedAttention graph: two more inputs whose rows replace the token embeddings
at given rows of the step's flattened token batch (a vision tower's output, model/vision/).

The rows go in after the family's embedding scale: Gemma 3 scales its text embeddings by
sqrt(hidden), and HF's Gemma3 inserts image features unscaled (`masked_scatter` on
`inputs_embeds` after `embed_tokens`, whose scale is inside it). A pass on the loaded graph
rather than a change to the conversion: the converted directories in users' caches and optimum
exports take it alike, and a text-only model compiles exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.errors import ModelLoadError

IMAGE_EMBEDS = "image_embeds"  # f32 [M, hidden]
IMAGE_ROWS = "image_rows"  # i64 [M]: rows of the step's flattened tokens they replace


@dataclass(frozen=True)
class ImageRules:
    """What image rows a compiled model takes (scheduler/media.py checks a request's against it)."""

    width: int | None  # the rows' width, its hidden size; None: it takes no images
    bidirectional_rows: int | None = None  # rows attend both ways, in images of at most this many (image_attention.py)
    grids: bool = False  # rows placed by M-RoPE: each image needs its grid


# between input_ids and the token table's Gather (the transformation's [T] -> [T, 1])
_ID_PATH = {"Unsqueeze", "Reshape", "Convert"}


def add_image_inputs(model: ov.Model) -> int:
    """In place, on a graph after paged.to_paged: returns the hidden size the rows must have."""
    embedded = _embeddings(model)
    hidden = embedded.get_partial_shape()[-1]
    if hidden.is_dynamic:
        raise ModelLoadError("image inputs: the token embeddings have no static hidden size")
    width = hidden.get_length()
    embeds = ops.parameter([-1, width], ov.Type.f32, name=IMAGE_EMBEDS)
    rows = ops.parameter([-1], ov.Type.i64, name=IMAGE_ROWS)
    for p, name in ((embeds, IMAGE_EMBEDS), (rows, IMAGE_ROWS)):
        p.output(0).set_names({name})
    consumers = list(embedded.get_target_inputs())
    flat = ops.reshape(embedded, ops.constant(np.array([-1, width], np.int64)), special_zero=False)
    updates = ops.convert_like(embeds, flat) if embedded.get_element_type() != ov.Type.f32 else embeds
    scattered = ops.scatter_update(flat, rows, updates, ops.constant(np.int64(0)))
    back = ops.reshape(scattered, ops.shape_of(embedded), special_zero=False).output(0)
    for target in consumers:
        target.replace_source_output(back)
    model.add_parameters([embeds, rows])
    model.validate_nodes_and_infer_types()
    return width


def _embeddings(model: ov.Model) -> ov.Output:
    """The token embeddings as the first layer takes them: the token table's Gather of input_ids,
    then the family's scale where it has one (a Multiply by a one-element constant)."""
    ids = next((p for p in model.get_parameters() if "input_ids" in p.output(0).get_names()), None)
    if ids is None:
        raise ModelLoadError("image inputs: the graph has no input_ids")
    out, gather = ids.output(0), None
    while gather is None:
        targets = [t for t in out.get_target_inputs()]
        gather = next((t.get_node() for t in targets if t.get_node().get_type_name() == "Gather"
                       and t.get_index() == 1), None)
        path = [t.get_node() for t in targets if t.get_node().get_type_name() in _ID_PATH]
        if gather is None and len(path) != 1:
            raise ModelLoadError("image inputs: cannot find the token table's Gather of input_ids in this graph")
        out = path[0].output(0) if gather is None else out
    embedded = gather.output(0)
    while (scale := _scale_of(embedded)) is not None:
        embedded = scale.output(0)
    return embedded


def _scale_of(x: ov.Output) -> ov.Node | None:
    """x's only consumer where it is a Multiply by a one-element constant (through a Convert)."""
    targets = list(x.get_target_inputs())
    if len(targets) != 1 or targets[0].get_node().get_type_name() != "Multiply":
        return None
    node = targets[0].get_node()
    other = node.input_value(1 - targets[0].get_index()).get_node()
    while other.get_type_name() == "Convert":
        other = other.input_value(0).get_node()
    is_scalar = other.get_type_name() == "Constant" and int(np.prod(other.get_output_shape(0))) == 1
    return node if is_scalar else None
