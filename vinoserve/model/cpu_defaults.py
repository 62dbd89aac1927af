"""What to compile and which KV cache, for this model on this CPU: every CPU-dependent default in
one table, each row with the measurement behind it.

The CPU plugin's own defaults change with the CPU (bf16 compute on AVX512_BF16 and AMX, f32
elsewhere; int8 activations where the matmul kernels allow them), and the fast choice on one
class was measured slower or less accurate on another. So a default here is taken only on the
class it was measured on; a class nobody measured keeps the plugin's own choice. A setting the
user asks for always wins.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import openvino as ov

from vinoserve.model import decode_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.cpu_class import CpuClass, this_cpu


@dataclass(frozen=True)
class ClassDefaults:
    """Defaults for compute at the plugin's default precision (bf16 on the first two classes)."""

    decode_model: bool  # `--decode-model auto` may take it (decode_model.wanted checks the model)
    kv_cache_precision: str | None  # with one compilation; None: the plugin's (with the decode model: u8)
    # The plugin's DYNAMIC_QUANTIZATION_GROUP_SIZE at the default compute precision; None: the plugin's
    dynamic_quantization_group_size: int | None
    # Low-bit weights: one f32 compilation whose low-bit MatMuls all run on vinoserve's kernel
    # (model/lowbit), where it builds; the fields above stand where it does not, or is not wanted.
    lowbit_main: bool = False
    # How far ahead (bytes) the kernel prefetches its weights: 1 KiB as chosen on the Emerald
    # Rapids; Zen 5's memory wants more in flight (below).
    lowbit_prefetch: int = 1024
    # In steps of two int8 planes (prompts, one sequence), the products whose other rows take one
    # (lowbit/rewrite.py, COARSE): "gate_up" (the MLP's gate and up) or "all_but_qkv"
    lowbit_coarse: str = "gate_up"
    # A mixture of experts takes `lowbit_main`'s one compilation even where dense models do not:
    # its experts' products on the kernel's LowBitExperts (each routed expert read once for all of
    # its rows), one copy of the experts where the decode model would hold a second. On AMX, OLMoE
    # Q4_0: prompts 2.9x llama.cpp where the bf16 compilation's GatherMatmul made 0.7x, decode
    # 2.4x (benchmarks/results/2026-12-03-moe-kernel.md).
    lowbit_main_experts: bool = False


DEFAULTS: dict[CpuClass, ClassDefaults] = {
    # The decode model (f32, int8 activations, the kernel) for steps of a few tokens, bf16 prompts:
    # decode 1.5-2x llama.cpp where the plugin's bf16 alone made 0.85x (benchmarks/results/
    # 2026-11-26-emerald-rapids.md, 2026-11-25-sapphire-rapids.md).
    CpuClass.AMX: ClassDefaults(decode_model=True, kv_cache_precision="bf16", dynamic_quantization_group_size=None,
                                lowbit_main_experts=True),
    # One f32 compilation with every low-bit MatMul on the kernel (bf16 decoded at 0.65x llama.cpp,
    # this at 1.2-1.5x); two int8 planes for prompts and one sequence's steps keep answers near f32's
    # (long-context perplexity 1.0008x); prefetch 4 KiB ahead for Zen 5's memory
    # (benchmarks/results/2026-11-28-zen5.md). Zen 4 is not measured on this code.
    CpuClass.AVX512_BF16: ClassDefaults(decode_model=False, kv_cache_precision="bf16",
                                        dynamic_quantization_group_size=0, lowbit_main=True,
                                        lowbit_prefetch=4096),
    # Skylake-SP to Ice Lake (no bf16 arithmetic) and Zen 2 / 3, Haswell to Alder Lake: one f32
    # compilation on the kernel's AVX-512 path (VNNI's, or Skylake-SP's without), else its AVX2 path. A
    # prompt's rows take two int8 planes in the attention's q/k/v (they fill the cache) and where
    # their logits are read, one elsewhere: AVX2 code, 1.5B Q4_0 / Q4_K_M, 2.3x / 1.6x less CPU a
    # prompt token than llama.cpp (two planes throughout: 1.9x / 1.3x), long-context perplexity
    # 1.001x f32's, the README's question answered Paris at 25 of 40 seeds (f32 27, one plane
    # throughout 9): benchmarks/results/2026-12-03-avx2-and-avx512.md.
    CpuClass.AVX512: ClassDefaults(decode_model=False, kv_cache_precision=None, dynamic_quantization_group_size=None,
                                   lowbit_main=True, lowbit_coarse="all_but_qkv"),
    CpuClass.AVX2: ClassDefaults(decode_model=False, kv_cache_precision=None, dynamic_quantization_group_size=None,
                                 lowbit_main=True, lowbit_coarse="all_but_qkv"),
    CpuClass.OTHER: ClassDefaults(decode_model=False, kv_cache_precision=None, dynamic_quantization_group_size=None),
}


def compute_precision(options: CompileOptions, core: ov.Core) -> str:
    return options.inference_precision or core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


def resolve(options: CompileOptions, core: ov.Core, model: ov.Model, cpu: CpuClass | None = None) -> CompileOptions:
    """`options` with every field left to the machine filled in: decode model, KV precision,
    dynamic quantization, q/k/v fusion, the main compilation on the kernel (`lowbit_main`)."""
    if options.device != "CPU":
        return replace(options, decode_model=False, fuse_projections=bool(options.fuse_projections))
    row = DEFAULTS[cpu or this_cpu()]
    options = replace(options, lowbit_prefetch=row.lowbit_prefetch, lowbit_coarse=row.lowbit_coarse)
    on_kernel = row.lowbit_main or (row.lowbit_main_experts and has_experts(model))
    if on_kernel and _left_to_kernel(options) and decode_model.has_low_bit_matmuls(model):
        # f32 compute's own cache here is u8; f16 takes bf16's bytes and moved the first reply
        # token less (40 chat prompts against f32, Zen 5)
        return replace(options, decode_model=False, inference_precision="f32", lowbit_main=True,
                       kv_cache_precision=options.kv_cache_precision or "f16",
                       fuse_projections=options.fuse_projections is not False)
    bf16 = compute_precision(options, core) == "bf16"
    use = options.decode_model
    if use is None:
        use = row.decode_model and bf16 and decode_model.wanted(options.kv_cache_precision, model)
    if use:
        options = decode_model.with_shared_cache(options)
    elif options.kv_cache_precision is None and bf16:
        options = replace(options, kv_cache_precision=row.kv_cache_precision)
    dq = options.dynamic_quantization_group_size
    if dq is None and bf16:
        dq = row.dynamic_quantization_group_size
    return replace(options, decode_model=bool(use), dynamic_quantization_group_size=dq,
                   fuse_projections=options.fuse_projections is not False)


def has_experts(model: ov.Model) -> bool:
    """Whether the graph holds a mixture of experts' products (model/moe.py)."""
    return any(node.get_type_name() == "GroupedMatMul" for node in model.get_ordered_ops())


def _left_to_kernel(options: CompileOptions) -> bool:
    """Whether nothing asked for rules out one f32 compilation on the kernel: no precision, no
    decode model, no int8 activations of the plugin's, no bf16 cache (f32 compute refuses one)."""
    return (options.inference_precision is None and options.decode_model is not True
            and options.lowbit_kernel is not False and options.dynamic_quantization_group_size is None
            and options.kv_cache_precision != "bf16")
