"""What an engine is asked to be (EngineConfig), how big its KV cache is, and what its steps cost."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.cache.kv_cache import num_blocks_for_bytes
from vinoserve.cache.rotation import kernel_supports_rotation
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.memory import available_memory_bytes
from vinoserve.model.paged import CacheLayout
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.vision.serving import find_mmproj
from vinoserve.model.weights import WeightFormat
from vinoserve.scheduler.scheduler import SchedulerConfig

# Without --kv-cache-size, the cache takes this share of the memory available at start (the
# host's free memory, or what a container's cgroup limit leaves if that is less).
DEFAULT_KV_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the built-in default model
    mmproj: str | None = None  # a vision projector GGUF: the model takes images (None: one found beside it)
    weight_format: WeightFormat = "auto"
    compile: CompileOptions = field(default_factory=CompileOptions)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_size_gb: float | None = None
    num_kv_blocks: int | None = None  # exact block count, overrides kv_cache_size_gb
    cache_eviction: CacheEvictionConfig | None = None  # None: the whole context stays cached
    host_rotation: bool = False  # rotate evicted-then-moved keys on the host even where the kernel could
    # Reuse computed KV blocks across requests sharing a prefix. Off while cache eviction is on
    # (evicted and rotated blocks no longer match a token prefix); None: on where it can be.
    enable_prefix_caching: bool | None = None
    # Prompt lookup by default: it proposes only where a sequence repeats its context and verifying
    # pays (Speculator); None: one token per sequence per step.
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    # Plan and set up step N+1 while step N computes, so that only sampling stays between two
    # steps. Cache eviction and steps that verify proposals run one at a time whatever this says.
    overlap_steps: bool = True
    # Sliding-window layers' tables hold only the blocks inside their window, in a pool shared
    # with the global layers' (cache/layer_groups.py). False: every layer keeps every block.
    window_sized_caches: bool = True
    # The language model takes image rows in place of token embeddings (model/image_inputs.py,
    # scheduler/media.py): two more inputs. False: the graph exactly as a text-only model's.
    image_inputs: bool = False

    @property
    def projector(self) -> Path | None:
        """The vision projector GGUF the model is served with, if any (it takes image rows then)."""
        return find_mmproj(self.model, self.mmproj)

    @property
    def prefix_caching(self) -> bool:
        if self.enable_prefix_caching and self.cache_eviction is not None:
            raise ValueError("prefix caching and cache eviction cannot be used together "
                             "(pass --no-enable-prefix-caching, or drop --cache-eviction)")
        return self.enable_prefix_caching is not False and self.cache_eviction is None

    def compile_options(self) -> CompileOptions:
        """Score outputs when evicting; the kernel's rotation inputs only where it is known to work
        (asked-for f32 compute with an f32/f16 cache): elsewhere the host rotates."""
        ev, c = self.cache_eviction, self.compile
        in_kernel = (ev is not None and ev.rotation and not self.host_rotation
                     and kernel_supports_rotation(c.inference_precision, c.kv_cache_precision))
        return replace(c, score_outputs=ev is not None, cache_rotation=in_kernel,
                       image_inputs=c.image_inputs or self.image_inputs or self.projector is not None)

    def num_blocks(self, layout: CacheLayout, num_buffers: int, per_sequence: int) -> int:
        """KV blocks to allocate (each `num_buffers` layers' worth): as asked, else the memory
        budget's worth, up to what max_num_seqs sequences of `per_sequence` blocks could use."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        if self.kv_cache_size_gb is not None:
            budget = int(self.kv_cache_size_gb * 2**30)
        else:
            budget = int(available_memory_bytes() * DEFAULT_KV_MEMORY_FRACTION)
        # More blocks than every sequence at full context could use would be memory for nothing.
        cap = self.scheduler.max_num_seqs * per_sequence + 1  # and the null block, where there is one
        blocks = min(num_blocks_for_bytes(budget, layout, num_buffers), cap)
        if blocks < 1:
            raise ValueError(f"a KV cache of {budget} bytes holds no block")
        return blocks


@dataclass
class StepStats:
    num_steps: int = 0
    step_seconds: float = 0.0  # whole steps: scheduling, packing, infer, sampling, outputs
    overlapped_seconds: float = 0.0  # of which host work done while a step computed (overlapped steps)
    num_generated_tokens: int = 0
