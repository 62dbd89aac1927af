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
    # Int8 planes for steps with prompt tokens on the kernel: 2 (near f32) or 1 (llama.cpp's)
    lowbit_prompt_planes: int = 2


DEFAULTS: dict[CpuClass, ClassDefaults] = {
    # Sapphire Rapids, 2 cores, 1.5B Q4_0 decode infer(): 73 ms on the decode model against 95 on
    # the bf16 one (the plugin gives bf16 compute no int8 activations where AMX is present:
    # openvino PR #35726 gates them to bf16 CPUs without AMX); one stream 1.23x, 8B 1.48x
    # llama.cpp against 1.19x. bf16 KV without it: decode infer() 7-24% less CPU time than u8 at
    # the same perplexity (Zen 4, docs/performance-lab-notes.md; the same kernels here).
    CpuClass.AMX: ClassDefaults(decode_model=True, kv_cache_precision="bf16", dynamic_quantization_group_size=None),
    # Zen 5 (EPYC family 26), 2 cores, 2026-11-27, `vinoserve bench llamacpp` against llama.cpp in
    # one run, 1.5B Q4_0 / Q4_K_M: the bf16 compilation without int8 activations decoded at 0.65x /
    # 0.53x and read prompts at 2.96x / 2.43x; one f32 compilation with every low-bit MatMul on
    # vinoserve's kernel decodes at 1.25x / 1.14x and reads prompts at 2.40x / 1.90x, with one copy
    # of the weights. The kernel's int8 activations alone (llama.cpp's) moved the built-in model's
    # first reply token off f32's twice as far as bf16 did; so steps with prompt tokens or one
    # sequence, and the logits, are quantized in two planes (lowbit_layout.hpp; the runner's
    # ModelRunner.planes), several sequences' decode steps in one: over 40 chat prompts the first
    # token's log-probability is then 0.0007 from f32's on average (bf16 0.028), and SmolLM2's
    # long-context perplexity 1.0000x f32's (one-plane decode steps left it 0.99-1.02x by chance;
    # bf16 without int8 activations 1.008x, with the plugin's 1.029x: issue 36, Zen 4). One plane
    # for prompts too read them at 3.7x; two planes 3.1x since 11-28 (registers kept, no spills).
    # The MLP's gate and up in one plane on a prompt's rows whose logits are not read (model/lowbit):
    # a 1.5B Q4_K_M prompt step 0.80x the time (Q4_K_M 3.45x llama.cpp, Q4_0 4.13x), the first
    # token 0.010 from f32's (40 of 40 the same), long-context perplexity 1.0008x f32's.
    # The kernel's prefetch 2 KiB ahead: 1.5B Q4_0 decode 1.044x 1 KiB's (one process, 8
    # alternating rounds, each faster; 4 KiB 1.042x), 2026-11-28; with the one-token clone, 4 KiB
    # against 2: 8B Q4_0 1.044x, 8B Q4_K_M 1.051x and 1.018x, 1.5B Q4_0 1.030x and 0.996x, Q4_K_M
    # 1.004x (its prompt step 0.998x the time), paired rounds in one process. With the kernel in
    # the main compilation, one-token steps run on its static-shaped clone (one_token.py,
    # CompileOptions.one_token): 1.5B Q4_0 / Q4_K_M decode 1.100x / 1.077x, +36-44 MiB, the same
    # arithmetic (2026-11-28).
    # Zen 4 (AVX-512 at half width) is not measured on this code.
    CpuClass.AVX512_BF16: ClassDefaults(decode_model=False, kv_cache_precision="bf16",
                                        dynamic_quantization_group_size=0, lowbit_main=True,
                                        lowbit_prefetch=4096),
    # Skylake-SP to Ice Lake (no bf16 arithmetic: f32 compute) and Zen 2 / 3, Haswell to Alder Lake:
    # one f32 compilation on the kernel's AVX-512 VNNI path where the CPU has it, else its AVX2
    # path (benchmarks/results/2026-12-03-avx2-and-avx512.md).
    CpuClass.AVX512: ClassDefaults(decode_model=False, kv_cache_precision=None, dynamic_quantization_group_size=None,
                                   lowbit_main=True),
    CpuClass.AVX2: ClassDefaults(decode_model=False, kv_cache_precision=None, dynamic_quantization_group_size=None,
                                 lowbit_main=True),
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
    options = replace(options, lowbit_prefetch=row.lowbit_prefetch, lowbit_prompt_planes=row.lowbit_prompt_planes)
    if row.lowbit_main and _left_to_kernel(options) and decode_model.has_low_bit_matmuls(model):
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


def _left_to_kernel(options: CompileOptions) -> bool:
    """Whether nothing asked for rules out one f32 compilation on the kernel: no precision, no
    decode model, no int8 activations of the plugin's, no bf16 cache (f32 compute refuses one)."""
    return (options.inference_precision is None and options.decode_model is not True
            and options.lowbit_kernel is not False and options.dynamic_quantization_group_size is None
            and options.kv_cache_precision != "bf16")
