"""A second compilation of the model for steps of a few tokens: f32 compute, int8 activations.

With bf16 compute (the CPU plugin's default on AVX512_BF16 and AMX CPUs) a FullyConnected with
4- or 8-bit weights decompresses every weight into a bf16 buffer on each call and multiplies in
bf16: right for a prompt chunk, wasted at one token, where the step streams the weights once. At
f32 compute the plugin instead quantizes the activations to int8 per group of 32 and multiplies
the packed low-bit weights with VNNI integer dot products, as llama.cpp does (nodes/fullyconnected.cpp,
`useDynamicQuantizationImpl`; it needs f32 activations): a 1.5B Q4_0 decode `infer()` 0.77x the
time (benchmarks/results/2026-11-25-sapphire-rapids-gguf-blocks.md).

So the model is compiled twice and the runner sends each step to one of them by its token
count. The decode model's 4- and 8-bit MatMuls run on vinoserve's own kernel where it builds
(model/lowbit: the same int8 activations; gate and up fused, block offsets inside the product;
at 1.5B about 1.4x the decode of the plugin's kernel, which unpacking binds), else on the
plugin's. Both write one KV cache, which fixes its precision: an f32 kernel reads f32 or u8
blocks, a bf16 one bf16 or u8, so the cache is u8. The cost is a second packed copy of the
weights (1.5B Q4_0: +0.8 GiB resident on the kernel, +1.0 on the plugin's), so `auto` takes it
only where both copies fit in half the machine's memory (or the container's limit): a server
whose weights are a larger share has better use for it (KV cache), and there several sequences
decode at once, where the decode model does not run anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import openvino as ov

from vinoserve.memory import memory_limit_bytes
from vinoserve.model import lowbit
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.errors import ModelLoadError

# Steps of at most this many tokens go to the decode model: a few sequences decoding, or one
# verifying its proposals (1 + k tokens): ahead of the bf16 kernels up to 24 tokens, behind at 32
# (benchmarks/results/2026-11-26-emerald-rapids.md).
MAX_TOKENS = 16
KV_PRECISION = "u8"
# `auto` takes the decode model when its packed copy is at most this share of the memory (both
# copies in half of it): on 24 GiB up to 8B-sized 4-bit models, where it still buys 1.5x decode
# for 1.8x resident memory (benchmarks/results/2026-11-26-emerald-rapids.md).
MEMORY_SHARE = 0.25
_LOW_BIT = {ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8}
_WEIGHT_PATH = {"Convert", "Multiply", "Subtract", "Add", "Reshape", "Concat", "Transpose"}


def has_low_bit_matmuls(model: ov.Model) -> bool:
    """Whether some MatMul reads 4- or 8-bit weights (the conversion's `auto`, `int4`, `int8`, or
    an int4/int8 IR): with f16 or f32 weights there is nothing for int8 activations to meet."""
    for node in model.get_ordered_ops():
        if node.get_type_name() == "Constant" and node.get_element_type() in _LOW_BIT:
            if any(t.get_node().get_type_name() == "Convert" for t in node.output(0).get_target_inputs()):
                return True
    return False


def packed_copy_bytes(model: ov.Model) -> int:
    """About what a compilation's packed weights take: the constants every MatMul and expert
    product multiplies by (through their Convert, scale and offset nodes), low-bit integers as
    they are, f16 scales widened to f32 (the plugin's packing, cpu-decode.md section 2), f32 scales
    and block offsets as they are. A token table read only by a Gather is read in place, not packed."""
    total, seen = 0, set()
    for node in model.get_ordered_ops():
        if node.get_type_name() in (lowbit.OP, lowbit.experts.OP):  # its weights, scales and offsets as they are
            total += sum(v.get_node().get_byte_size() for v in node.input_values()[1:]
                         if v.get_node().get_type_name() == "Constant")
            continue
        if node.get_type_name() not in ("MatMul", "GroupedMatMul"):  # a mixture of experts' products
            continue
        stack = [node.input_value(1).get_node()]
        while stack:
            n = stack.pop()
            if n.get_instance_id() in seen:
                continue
            seen.add(n.get_instance_id())
            if n.get_type_name() == "Constant":
                total += n.get_byte_size() * (2 if n.get_element_type() == ov.Type.f16 else 1)
            elif n.get_type_name() in _WEIGHT_PATH:
                stack.extend(v.get_node() for v in n.input_values())
    return total


def wanted(kv_precision: str | None, model: ov.Model) -> bool:
    """On a CPU class where it pays (cpu_defaults.py), what the model must also allow: low-bit
    weights, a KV precision both compilations accept (none asked for, or u8), and memory to spare
    for the second copy."""
    return (kv_precision in (None, KV_PRECISION) and has_low_bit_matmuls(model)
            and packed_copy_bytes(model) <= MEMORY_SHARE * memory_limit_bytes())


def with_shared_cache(options: CompileOptions) -> CompileOptions:
    """Options for a main compilation that shares its cache with the decode model."""
    if options.kv_cache_precision not in (None, KV_PRECISION):
        raise ModelLoadError(f"the decode model shares a {KV_PRECISION} KV cache with the main one; "
                             f"{options.kv_cache_precision} was asked for (turn the decode model off to keep it)")
    return replace(options, decode_model=True, kv_cache_precision=KV_PRECISION)


@dataclass(frozen=True)
class DecodeGraph:
    """What the decode model compiled, as the startup log tells it."""

    packed_bytes: int  # about what its second copy of the weights takes
    kernel_matmuls: int = 0  # MatMuls on vinoserve's kernel (model/lowbit)
    kernel_unavailable: str = ""  # why none are, where it was wanted
    experts: int = 0  # a mixture of experts' products on the kernel (kernel_matmuls includes them)

    def describe(self) -> str:
        matmuls = (f"{self.kernel_matmuls - self.experts} matmuls on vinoserve's low-bit kernel" if self.kernel_matmuls else
                   f"the plugin's matmuls ({self.kernel_unavailable or 'none the low-bit kernel takes'})")
        return (f"steps of up to {MAX_TOKENS} tokens on the decode model, a second packed copy of the weights "
                f"(about {self.packed_bytes / 2**30:.2f} GiB; --decode-model off saves it), {matmuls}")


def graph(prepared: ov.Model, raw: ov.Model | None, options: CompileOptions,
          core: ov.Core) -> tuple[ov.Model, DecodeGraph]:
    """The graph the decode model compiles. `prepared` is the main compilation's; `raw` (None
    when options turn the kernel off) the same before its offsets were split and projections
    fused: here its low-bit MatMuls, gate with up fused, go to vinoserve's kernel, and what the
    kernel does not take is prepared as the main graph is."""
    if raw is None:
        return prepared, DecodeGraph(packed_copy_bytes(prepared))
    try:
        # The token table stays the plugin's: the main compilation reads it too, and the library's
        # gather would hold a copy (AMX, where this runs, has not been measured with it).
        count = lowbit.kernel_graph(raw, core, bool(options.fuse_projections), prefetch=options.lowbit_prefetch,
                                    gathers=False)
    except lowbit.Unavailable as e:
        if options.lowbit_kernel:
            raise ModelLoadError(f"the low-bit kernel was asked for: {e}") from e
        return prepared, DecodeGraph(packed_copy_bytes(prepared), kernel_unavailable=str(e))
    return raw, DecodeGraph(packed_copy_bytes(raw), count, experts=lowbit.experts.count(raw))


def properties(main: dict[str, str]) -> dict[str, str]:
    """The main compilation's properties (its KV precision already KV_PRECISION), with f32 compute
    and int8 activations per 32 inputs (the GGUF block size: a larger group did not take the fast
    path with Q4_0's groups of 32)."""
    assert main.get("KV_CACHE_PRECISION") == KV_PRECISION, "the two compilations share one cache"
    return {**main, "INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}
