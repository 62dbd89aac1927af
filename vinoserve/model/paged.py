"""Turn a stateful LLM graph into a PagedAttention model and compile it.

The transformation runs in memory at every load: a transformed model saved to disk loses the
rt_info its PagedAttention nodes need and no longer compiles (see shared docs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from vinoserve.memory import resident_bytes
from vinoserve.model import cpu_defaults, decode_model, lowbit, one_token
from vinoserve.model import fuse_projections as projections
from vinoserve.model.block_offsets import split_block_offsets
from vinoserve.model.blocks import ROPE_OFFSETS
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.graph_facts import (MAX_CONTEXT_LEN_INPUT, SLIDING_WINDOW_INPUT, GraphFacts, layer_index,
                                         lm_head, read_graph_facts)
from vinoserve.model.image_attention import TOKEN_TYPES, add_token_types
from vinoserve.model.image_inputs import IMAGE_EMBEDS, add_image_inputs

SAMPLED_INDICES = "sampled_token_indices"
@dataclass(frozen=True)
class CacheLayout:
    """Per-layer cache tensors as the compiled kernel wants them: [num_blocks, *block_shape]."""

    key_type: ov.Type
    value_type: ov.Type
    key_block_shape: tuple[int, ...]
    value_block_shape: tuple[int, ...]
    block_size: int

    def bytes_per_block(self) -> int:
        """Key + value bytes of one block in one layer (u4 packs two values a byte)."""
        k = int(np.prod(self.key_block_shape)) * self.key_type.bitwidth
        v = int(np.prod(self.value_block_shape)) * self.value_type.bitwidth
        return (k + v + 7) // 8


@dataclass(frozen=True)
class MainKernel:
    """The single compilation's low-bit MatMuls on vinoserve's kernel (cpu_defaults.py)."""

    matmuls: int = 0  # expert products included
    unavailable: str = ""  # why none are, where the CPU class wanted them
    experts: int = 0  # a mixture of experts' products on the kernel (lowbit/experts.py)
    one_token_bytes: int | None = None  # what its one-token clone (one_token.py) added resident; None: none
    one_token_error: str = ""  # why there is none, where it could not be built

    def describe(self) -> str:
        if self.matmuls:
            clone = "" if self.one_token_bytes is None else \
                f" and its one-token clone with static shapes (+{self.one_token_bytes / 2**20:.0f} MiB resident)"
            missing = f" (no one-token clone: {self.one_token_error})" if self.one_token_error else ""
            return (f"one f32 compilation{clone}, {self.matmuls - self.experts} matmuls on vinoserve's low-bit kernel "
                    f"(--lowbit-kernel off: the plugin's){missing}")
        return f"the plugin's matmuls ({self.unavailable})" if self.unavailable else ""


@dataclass
class PagedModel:
    facts: GraphFacts
    compiled: ov.CompiledModel
    options: CompileOptions
    layout: CacheLayout
    # for steps of at most decode_tokens tokens: the decode model, or the kernel compilation's
    # one-token clone
    decode: ov.CompiledModel | None = None
    decode_graph: decode_model.DecodeGraph | None = None  # the decode model's weights' size, its kernel
    main_kernel: MainKernel = MainKernel()
    gathered: int = 0  # the main compilation's GatherMatmul ops (the plugin's fused expert products)

    @property
    def decode_tokens(self) -> int | None:
        """Steps of at most this many tokens run on `decode` (None: there is none)."""
        if self.decode is None:
            return None
        return decode_model.MAX_TOKENS if self.decode_graph is not None else one_token.TOKENS

    @property
    def proposal_cap(self) -> int | None:
        """Tokens that speculation's proposals keep a step within (speculative.py): the decode
        model's, whose steps cost far less; the one-token clone's would leave room for none, so
        proposals cross it as into any larger step."""
        return decode_model.MAX_TOKENS if self.decode_graph is not None else None

    def describe(self) -> str:
        """What was compiled beyond the plain graph, for the startup log ("" for nothing)."""
        compiled = self.decode_graph.describe() if self.decode_graph else self.main_kernel.describe()
        return "; ".join(part for part in (compiled, self._experts()) if part)

    def _experts(self) -> str:
        """Where a mixture of experts' products run ("" for a dense model)."""
        n = self.facts.expert_products
        kernel = "on vinoserve's low-bit kernel (routed experts only, each expert's rows in one product)"
        plugin = "on the plugin's GatherMatmul (routed experts only; a prompt's one per token and expert)"
        if not n:
            return ""
        if self.main_kernel.experts:  # those whose rows are not whole tiles of 16 stay the plugin's
            done = self.main_kernel.experts
            if done < n:
                return f"{done} of {n} expert products {kernel}, the rest {plugin}"
            return f"{n} expert products {kernel}"
        if self.decode_graph is not None and self.decode_graph.experts:
            return f"{n} expert products {plugin}, the decode model's {kernel}"
        if self.gathered < n:  # a block the plugin's pattern did not match: warn, it is far slower
            return (f"{n - self.gathered} of {n} expert products NOT gathered by the plugin: every token runs "
                    f"through every expert (the plugin did not recognise this export's expert block; a "
                    f"current optimum-intel's exports are)")
        return f"{n} expert products {plugin}"

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def inference_precision(self) -> str:
        return self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    @property
    def input_names(self) -> set[str]:
        return {i.get_any_name() for i in self.compiled.inputs}

    @property
    def image_width(self) -> int | None:
        """The hidden size of the image rows it takes (model/image_inputs.py); None: it takes none."""
        embeds = next((i for i in self.compiled.inputs if IMAGE_EMBEDS in i.get_names()), None)
        return None if embeds is None else embeds.get_partial_shape()[1].get_length()

    @property
    def image_grids(self) -> bool:
        """It places image rows by M-RoPE (an image's grid gives their positions: scheduler/media.py):
        vinoserve's graphs take rope_offsets, an optimum export's its three streams as position_ids."""
        return ROPE_OFFSETS in self.input_names or self.position_streams

    @property
    def position_streams(self) -> bool:
        """position_ids is [3, tokens]: M-RoPE's temporal, height and width streams. A Qwen-VL
        optimum export takes them as [3, batch, tokens], which the PagedAttention transformation
        makes [3, tokens]; the runner feeds them as they are rather than the graph being rewritten
        to vinoserve's rope_offsets form, so the export's own M-RoPE subgraph computes the angles."""
        ids = next((i for i in self.compiled.inputs if "position_ids" in i.get_names()), None)
        return ids is not None and ids.get_partial_shape().rank.get_length() == 2

    @property
    def bidirectional_images(self) -> bool:
        """Its image rows attend to each other both ways (model/image_attention.py)."""
        return TOKEN_TYPES in self.input_names


def to_paged(model: ov.Model, options: CompileOptions, sliding_windows: tuple[int, ...] = ()) -> ov.Model:
    """In place: SDPA + KV state -> PagedAttention (block tables per layer or shared, see
    CompileOptions) with each layer's attention window, plus a row gather before the LM head so a
    step computes logits only for the tokens it samples."""
    try:
        paged_attention_transformation(
            model, options.per_layer_block_tables, options.score_outputs, options.score_outputs,
            options.cache_rotation, False, False, False,
        )
    except RuntimeError as e:
        raise ModelLoadError(f"OpenVINO's PagedAttention transformation cannot convert this model: "
                             f"{last_line(e)}") from e
    if sliding_windows:
        _set_windows(model, sliding_windows)
    head = lm_head(model)
    indices = ops.parameter([-1], ov.Type.i64, name=SAMPLED_INDICES)
    indices.output(0).set_names({SAMPLED_INDICES})
    hidden = head.input(0).get_source_output()
    head.input(0).replace_source_output(ops.gather(hidden, indices, ops.constant(np.int64(0))).output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()
    return model


def _set_windows(model: ov.Model, windows: tuple[int, ...]) -> None:
    """The transformation finds a window only in the mask patterns of a few exports (Phi-3's,
    gpt-oss'): each layer's is set from the config instead, for GGUF and IR models alike. The op
    counts the query itself, as HF does: key j is seen from query i when i - j < window."""
    for node in model.get_ordered_ops():
        if node.get_type_name() != "PagedAttentionExtension":
            continue
        if node.input_value(MAX_CONTEXT_LEN_INPUT).get_node().get_friendly_name() != "max_context_len":
            raise ModelLoadError("this OpenVINO's PagedAttention inputs are not in the order vinoserve knows")
        layer = layer_index(node)
        if layer >= len(windows):
            raise ModelLoadError(f"the config gives sliding windows for {len(windows)} layers; the graph has more")
        node.input(SLIDING_WINDOW_INPUT).replace_source_output(ops.constant(np.int32(windows[layer])).output(0))


def compile_paged(model: ov.Model, options: CompileOptions, core: ov.Core | None = None,
                  sliding_windows: tuple[int, ...] = (), bidirectional_images: bool = False) -> PagedModel:
    """`sliding_windows`: each layer's, from the model's config (empty: as the transformation found
    them). `bidirectional_images`: the family's image rows attend to each other both ways (with
    options.image_inputs only: model/image_attention.py)."""
    core = core or ov.Core()
    if len(set(sliding_windows)) > 1:  # sliding and global layers: a table per layer group
        options = replace(options, per_layer_tables=True)
    options, kernel = _resolve(options, core, model)
    facts = read_graph_facts(to_paged(model, options, sliding_windows))
    if options.image_inputs:  # before the clone below: the decode model takes them too (the runner feeds none)
        add_image_inputs(model)
        if bidirectional_images:
            add_token_types(model)
    # the decode model's graph starts from this one, before the passes below (model/lowbit)
    raw = model.clone() if options.decode_model and options.lowbit_kernel is not False else None
    if options.lowbit_main:  # int8 planes a step as the runner sets them (lowbit.PLANES)
        kernel = MainKernel(lowbit.kernel_graph(model, core, bool(options.fuse_projections), planes=True,
                                                prefetch=options.lowbit_prefetch, sampled=SAMPLED_INDICES,
                                                coarse=options.lowbit_coarse), experts=lowbit.experts.count(model))
    else:
        split_block_offsets(model)  # after to_paged: the LM head's correction must read the gathered rows
        if options.fuse_projections:
            projections.fuse_projections(model)
    compiled = _compile(core, model, options.device, options.properties())
    layout = _cache_layout(compiled)
    decode, decode_graph = None, None
    if options.decode_model:
        graph, decode_graph = decode_model.graph(model, raw, options, core)
        decode = _compile(core, graph, options.device, decode_model.properties(options.properties()))
    elif kernel.matmuls and options.one_token:
        decode, kernel = _one_token_clone(core, model, options, kernel)
    if decode is not None and _cache_layout(decode) != layout:
        raise ModelLoadError(f"the second compilation's KV cache layout differs from the main one's: "
                             f"{_cache_layout(decode)} vs {layout}")
    # what the plugin made of the experts the kernel did not take (the log warns where it made
    # no GatherMatmul of them)
    gathered = _count_layers(compiled, "GatherMatmul") if facts.expert_products > kernel.experts else 0
    return PagedModel(facts, compiled, options, layout, decode, decode_graph, kernel, gathered)


def _resolve(options: CompileOptions, core: ov.Core, model: ov.Model) -> tuple[CompileOptions, MainKernel]:
    """The CPU class's defaults; where they put the main compilation on the kernel and it cannot
    be built here, the class's defaults without it (or, asked for, one clear error)."""
    resolved = cpu_defaults.resolve(options, core, model)
    if not resolved.lowbit_main:
        return resolved, MainKernel()
    try:
        lowbit.library()
    except lowbit.Unavailable as e:
        if options.lowbit_kernel:
            raise ModelLoadError(f"the low-bit kernel was asked for: {e}") from e
        return cpu_defaults.resolve(replace(options, lowbit_kernel=False), core, model), MainKernel(0, str(e))
    return resolved, MainKernel()


def _one_token_clone(core: ov.Core, model: ov.Model, options: CompileOptions,
                     kernel: MainKernel) -> tuple[ov.CompiledModel | None, MainKernel]:
    """The kernel compilation's one-token clone, and what it added resident; where a graph does
    not take the static shapes, none (a speed-up, not a reason to refuse the model), and why."""
    before = resident_bytes()
    try:
        clone = _compile(core, one_token.graph(model), options.device, options.properties())
    except (RuntimeError, ModelLoadError) as e:
        return None, replace(kernel, one_token_error=last_line(e))
    return clone, replace(kernel, one_token_bytes=max(0, resident_bytes() - before))


def _count_layers(compiled: ov.CompiledModel, layer_type: str) -> int:
    """How many of the plugin's executable graph's nodes are of `layer_type`."""
    return sum(node.get_rt_info()["layerType"].astype(str) == layer_type
               for node in compiled.get_runtime_model().get_ops())


def _compile(core: ov.Core, model: ov.Model, device: str, properties: dict[str, str]) -> ov.CompiledModel:
    try:
        return core.compile_model(model, device, properties)
    except RuntimeError as e:
        # e.g. a bf16 KV cache with f32 compute on a CPU without bf16: the plugin refuses it.
        raise ModelLoadError(f"{device} cannot run this model with {properties}: {last_line(e)}") from e


def _cache_layout(compiled: ov.CompiledModel) -> CacheLayout:
    key = next(i for i in compiled.inputs if i.get_any_name() == "key_cache.0")
    value = next(i for i in compiled.inputs if i.get_any_name() == "value_cache.0")
    k_shape = tuple(d.get_length() for d in key.get_partial_shape()[1:])
    v_shape = tuple(d.get_length() for d in value.get_partial_shape()[1:])
    # Values are [Hkv, block, S (+ per-token quant params)] on CPU and GPU; keys may carry
    # per-block quant params in the block dim, so the block size is read from the value side.
    return CacheLayout(key.get_element_type(), value.get_element_type(), k_shape, v_shape, v_shape[1])
