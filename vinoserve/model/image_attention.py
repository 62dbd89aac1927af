"""Image rows that attend to each other both ways in prefill, as HF's Gemma3ForConditionalGeneration
(token_type_ids -> a bidirectional block per image) and llama.cpp's mtmd (a non-causal batch) do.

PagedAttention takes this as its `token_type_ids` input (one i32 per row of the step's flattened
tokens); the transformation feeds it an empty constant. Measured on the CPU plugin of OpenVINO
2026.4.1 against numpy attention (1e-7): a row typed 1 also sees every LATER row of its run of
consecutive 1s in the same sequence; every other row stays causal; an empty input is plain causal;
past tokens (past_lens) and several sequences in one step are handled. Its sliding window applies
only outside the run, where HF's Gemma 3 keeps the window on the past rows of an image too: the two
differ only for an image longer than the window, which the engine refuses (Gemma 3's real images
are 256 rows, its windows 512 and more). `qq_bias`, the op's other query-query input (tree
speculation), cannot do it: a mask allowing an image's later rows still gave causal attention.

Cached rows cannot see rows computed after them, so an image's rows go into one prefill chunk and
a prefix-cache hit never ends inside one (scheduler/scheduler.py).
"""
from __future__ import annotations

import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.errors import ModelLoadError

TOKEN_TYPES = "token_type_ids"  # i32 [T] (1: an image row) or [0] (a step without images: causal)
TOKEN_TYPES_INPUT = 25  # of PagedAttentionExtension, 2026.4.1's order
_INPUTS_KNOWN = 28
# config.json's model_type (GGUF conversions write HF's text model type) of language models whose
# image rows attend to each other both ways
BIDIRECTIONAL_FAMILIES = frozenset({"gemma3", "gemma3_text"})


def bidirectional_images(model_type: str) -> bool:
    """Whether this family's image rows attend to each other both ways."""
    return model_type in BIDIRECTIONAL_FAMILIES


def max_image_rows(sliding_windows: tuple[int, ...], max_context: int) -> int:
    """The most rows an image may have for the kernel's attention inside it to be HF's: the
    shortest sliding window (module doc), else the context."""
    return min((w for w in sliding_windows if w), default=max_context)


def add_token_types(model: ov.Model) -> None:
    """In place, on a graph after paged.to_paged: one `token_type_ids` input that every
    PagedAttention node takes."""
    types = ops.parameter([-1], ov.Type.i32, name=TOKEN_TYPES)
    types.output(0).set_names({TOKEN_TYPES})
    nodes = [n for n in model.get_ordered_ops() if n.get_type_name() == "PagedAttentionExtension"]
    if not nodes or any(n.get_input_size() != _INPUTS_KNOWN for n in nodes):
        raise ModelLoadError("this OpenVINO's PagedAttention takes no token_type_ids where vinoserve knows it: "
                             "images whose rows attend both ways cannot be served")
    for node in nodes:
        node.input(TOKEN_TYPES_INPUT).replace_source_output(types.output(0))
    model.add_parameters([types])
    model.validate_nodes_and_infer_types()
