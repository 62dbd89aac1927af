"""How a model is compiled: the options every compilation takes, the plugin properties they make.
Its own module: paged.py compiles with them, and the CPU defaults (cpu_defaults.py) and the
decode model (decode_model.py), which paged.py asks, read and refine them."""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("f32", "f16", "bf16")
KV_PRECISIONS = ("f32", "f16", "bf16", "u8", "u4")


@dataclass(frozen=True)
class CompileOptions:
    device: str = "CPU"
    inference_precision: str | None = None  # None: the plugin's default for this machine
    kv_cache_precision: str | None = None
    num_threads: int | None = None
    score_outputs: bool = False  # per-layer attention scores, for cache eviction
    cache_rotation: bool = False  # in-kernel RoPE re-rotation inputs
    fuse_projections: bool | None = None  # q/k/v as one MatMul; None: on CPU (see fuse_projections)
    decode_model: bool | None = None  # a second compilation for steps of few tokens; None: where it pays (decode_model.py)
    # low-bit matmuls on vinoserve's kernel (model/lowbit) where the CPU class puts them: the decode
    # model's, or the single compilation's; None: where it builds and runs
    lowbit_kernel: bool | None = None
    # resolved (cpu_defaults.py): the main compilation's low-bit matmuls are on the kernel
    lowbit_main: bool = False
    # resolved (cpu_defaults.py): how far ahead (bytes) the kernel prefetches its weights
    lowbit_prefetch: int = 1024
    # resolved (cpu_defaults.py): in the kernel's steps of two int8 planes, which products take the
    # second only on the rows whose logits are read (model/lowbit/rewrite.py, COARSE)
    lowbit_coarse: str = "gate_up"
    # with the kernel's one compilation, a static-shaped clone of it for one-token steps
    # (one_token.py); False: none
    one_token: bool = True
    # int8 activations per this many inputs in matmuls with low-bit weights (0: off); None: per
    # CPU class (cpu_defaults.py)
    dynamic_quantization_group_size: int | None = None
    per_layer_tables: bool = False  # a block_indices input per layer whatever else is on (set for mixed windows)
    # image rows in place of token embeddings (model/image_inputs.py); False: the graph as converted
    image_inputs: bool = False

    def __post_init__(self) -> None:
        if self.inference_precision not in (None, *PRECISIONS):
            raise ValueError(f"inference precision {self.inference_precision!r}; one of {', '.join(PRECISIONS)}")
        if self.kv_cache_precision not in (None, *KV_PRECISIONS):
            raise ValueError(f"KV cache precision {self.kv_cache_precision!r}; one of {', '.join(KV_PRECISIONS)}")

    @property
    def per_layer_block_tables(self) -> bool:
        """One block_indices input per layer where layers read different tables: eviction's (and
        eviction is what asks for scores) or layer groups' (sliding and global layers, see
        cache/layer_groups.py). Otherwise one shared input, as genai compiles it."""
        return self.score_outputs or self.per_layer_tables

    def properties(self) -> dict[str, str]:
        props = {"NUM_STREAMS": "1"}  # one step at a time; let the op use all threads
        # The plugin keeps kernels per input shape, 5,000 by default: steps of ever new sizes grew a
        # server's memory by ~1.5 MB each, to ~400 MB (docs/reliability.md); 256 cost no throughput.
        if self.device == "CPU":
            props["CPU_RUNTIME_CACHE_CAPACITY"] = "256"
        if self.inference_precision:
            props["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if self.dynamic_quantization_group_size is not None:
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(self.dynamic_quantization_group_size)
        elif self.inference_precision == "f32":
            # f32 asked for is f32 arithmetic: on VNNI/AMX CPUs the plugin otherwise rounds the
            # activations of every matmul with int8 weights to int8 (the f16 conversion's token
            # table, all of int8's), moving logits by ~1% (0.46 at a scale of 40 for SmolLM2).
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        if self.kv_cache_precision:
            props["KV_CACHE_PRECISION"] = self.kv_cache_precision
        if self.num_threads:
            props["INFERENCE_NUM_THREADS"] = str(self.num_threads)
        return props
