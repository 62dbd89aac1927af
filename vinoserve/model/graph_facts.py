"""What a PagedAttention graph itself says about its model, read after the transformation.

The number of layers, the KV heads and head size of each, each layer's sliding window and the
vocabulary are certain in the graph, whatever the architecture; config.json names them differently
per family (or not at all), so they are taken from here. The LM head is found from the `logits`
output, not by a node name, so optimum-cli exports and our own GGUF conversions are read alike.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import openvino as ov

from vinoserve.model import moe
from vinoserve.model.errors import ModelLoadError

# PagedAttentionExtension's inputs (openvino 2026.4): q, k, v, key_cache.N, value_cache.N, past_lens,
# subsequence_begins, block_indices, block_indices_begins, scale, sliding_window (tokens, 0: none),
# alibi_slopes, max_context_len, ...
KEY_CACHE_INPUT, SLIDING_WINDOW_INPUT, MAX_CONTEXT_LEN_INPUT = 3, 10, 12
# Ops that may stand between the LM head's MatMul and `logits`, the activation on input 0: a
# precision Convert, a bias Add, Gemma 2's soft-capping (Divide, Tanh, Multiply).
_AFTER_LM_HEAD = {"Convert", "Add", "Divide", "Tanh", "Multiply"}


@dataclass(frozen=True)
class GraphFacts:
    num_layers: int
    num_kv_heads: int
    head_size: int  # of the keys: what cache rotation turns
    vocab_size: int
    # Per layer, in tokens, query included (0: the whole context); empty when no layer has one.
    sliding_windows: tuple[int, ...]
    expert_products: int = 0  # a mixture of experts' products (moe.is_expert_product)

    @property
    def has_sliding_windows(self) -> bool:
        return bool(self.sliding_windows)


def read_graph_facts(model: ov.Model) -> GraphFacts:
    """From a model after paged_attention_transformation (before compiling: the PA nodes' rt_info
    holds the head counts the compiled cache inputs get their shapes from)."""
    layers = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() == "PagedAttentionExtension":
            layers[layer_index(node)] = node
    if not layers or sorted(layers) != list(range(len(layers))):
        raise ModelLoadError("the PagedAttention transformation found no attention layers it could convert "
                             "(is this a decoder exported with --task text-generation-with-past?)")
    kv = {i: _kv_shape(node) for i, node in layers.items()}
    if len(set(kv.values())) > 1:
        raise ModelLoadError(f"layers with different KV heads or head sizes are not supported "
                             f"(layer 0: {kv[0]}, layer {next(i for i in kv if kv[i] != kv[0])}: "
                             f"{next(v for v in kv.values() if v != kv[0])})")
    heads, head_size = kv[0]
    windows = tuple(_sliding_window(layers[i]) for i in range(len(layers)))
    experts = sum(map(moe.is_expert_product, model.get_ordered_ops()))
    return GraphFacts(len(layers), heads, head_size, _vocab_size(model), windows if any(windows) else (), experts)


def lm_head(model: ov.Model) -> ov.Node:
    """The MatMul that makes the logits."""
    node = _logits(model).get_node().input_value(0).get_node()
    while node.get_type_name() in _AFTER_LM_HEAD:
        node = node.input_value(0).get_node()
    if node.get_type_name() != "MatMul":
        raise ModelLoadError(f"cannot find the LM head: 'logits' comes from a {node.get_type_name()}, "
                             f"not a MatMul")
    return node


def _logits(model: ov.Model) -> ov.Output:
    out = next((o for o in model.outputs if "logits" in o.get_names()), None)
    if out is None:
        raise ModelLoadError(f"the model has no 'logits' output (outputs: "
                             f"{', '.join(o.get_any_name() for o in model.outputs)})")
    return out


def _vocab_size(model: ov.Model) -> int:
    last = _logits(model).get_partial_shape()[-1]
    if last.is_dynamic:
        raise ModelLoadError("the 'logits' output has no static vocabulary dimension")
    return last.get_length()


def layer_index(node: ov.Node) -> int:
    names = node.input_value(KEY_CACHE_INPUT).get_names()
    index = next((int(m.group(1)) for n in names if (m := re.fullmatch(r"key_cache\.(\d+)", n))), None)
    if index is None:
        raise ModelLoadError(f"a PagedAttention node reads no key_cache.N input ({', '.join(names)})")
    return index


def _kv_shape(node: ov.Node) -> tuple[int, int]:
    rt = node.get_rt_info()
    if "num_k_heads" not in rt or "k_head_size" not in rt:
        raise ModelLoadError("the PagedAttention nodes carry no KV head counts (this OpenVINO's transformation "
                             "is not the one vinoserve knows)")
    return rt["num_k_heads"].astype(int), rt["k_head_size"].astype(int)


def _sliding_window(node: ov.Node) -> int:
    """The transformation writes a layer's window as a small constant expression (Gemma's is the
    negated mask offset): evaluate it."""
    value = _constant_value(node.input_value(SLIDING_WINDOW_INPUT))
    if value is None:
        raise ModelLoadError("a layer's sliding window is not a constant the graph can be asked for")
    return int(np.ravel(value)[0])


def _constant_value(out: ov.Output) -> np.ndarray | None:
    node = out.get_node()
    if node.get_type_name() == "Constant":
        return node.get_data()
    args = [_constant_value(node.input_value(i)) for i in range(node.get_input_size())]
    if any(a is None for a in args):
        return None
    results = [ov.Tensor(node.get_output_element_type(i), node.get_output_shape(i))
               for i in range(node.get_output_size())]
    if not node.evaluate(results, [ov.Tensor(np.ascontiguousarray(a)) for a in args]):
        return None
    return results[out.get_index()].data
