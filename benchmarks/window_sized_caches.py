"""Window-sized caches for sliding-window layers (cache/layer_groups.py), before and after.

  bytes  KV bytes one sequence holds at 8k / 32k / 128k for Gemma 3's public configs, bf16 cache,
         steps of 256 tokens: every layer keeping every block (before) against a table per layer
         group over one pool (after), from the engine's own allocation code (padding included)
  pool   a random Gemma-3-shaped model (12 layers, 2 global, window 256, 8k context) through the
         engine at f32: N sequences of 4K tokens in a KV pool of --pool-sequences full ones' bytes,
         how many hold KV at once at most (long outputs, so memory is what limits it),
         preemptions, wall time; before and after

    python benchmarks/window_sized_caches.py bytes
    python benchmarks/window_sized_caches.py pool --sequences 16 --pool-sequences 4

`pool` needs the test extras (torch, transformers: the model is written through the tests' GGUF writer).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vinoserve.cache.block_manager import blocks_held
from vinoserve.cache.layer_groups import LayerGroups

BLOCK, STEP = 32, 256
# layers, global layers every 6th (Gemma 3's pattern), KV heads, head size, window (HF configs)
GEMMA3 = {"1B": (26, 1, 256, 512), "4B": (34, 4, 256, 1024), "12B": (48, 8, 256, 1024), "27B": (62, 16, 128, 1024)}


def windows_of(layers: int, window: int) -> tuple[int, ...]:
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers))


def kv_bytes(layers: int, kv_heads: int, head: int, window: int, context: int) -> tuple[float, float]:
    """(before, after) bytes of one sequence at `context` tokens, bf16 keys and values."""
    per_layer_block = 2 * kv_heads * BLOCK * head * 2
    groups = LayerGroups.of(windows_of(layers, window), layers)
    before = -(-context // BLOCK) * layers * per_layer_block
    after = blocks_held(groups.windows, BLOCK, context, STEP) * groups.num_slots * per_layer_block
    return before, after


def bytes_table(_args) -> None:
    print("| model (global/sliding layers) | groups x layers | 8k GiB | 32k GiB | 128k GiB | 32k after/before |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (layers, kv_heads, head, window) in GEMMA3.items():
        groups = LayerGroups.of(windows_of(layers, window), layers)
        cells, ratio = [], 0.0
        for context in (8192, 32768, 131072):
            before, after = kv_bytes(layers, kv_heads, head, window, context)
            cells.append(f"{before / 2**30:.2f} -> {after / 2**30:.2f}")
            ratio = after / before if context == 32768 else ratio
        n_global = sum(w == 0 for w in windows_of(layers, window))
        print(f"| Gemma 3 {name} ({n_global}/{layers - n_global}) | {groups.num_groups} x {groups.num_slots} | "
              f"{' | '.join(cells)} | {ratio:.3f} |")


def pool(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_fixtures import family_gguf

    from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
    from vinoserve.model.compile_options import CompileOptions
    from vinoserve.scheduler.sampling_params import SamplingParams
    from vinoserve.scheduler.scheduler import SchedulerConfig

    spec = dict(arch="gemma3", heads=4, kv_heads=1, head_dim=64, layers=12, hidden=256, intermediate=512,
                tie=True, sliding_window=256, max_positions=8192)
    hf, path = family_gguf(spec, Path(tempfile.mkdtemp()) / "gemma3-12l.gguf")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, hf.config.vocab_size, args.length - args.out).tolist() for _ in range(args.sequences)]
    probe = LLMEngine(EngineConfig(model=str(path), compile=CompileOptions("CPU", "f32", "f32"), num_kv_blocks=8),
                      log=lambda m: None)
    budget = args.pool_sequences * -(-args.length // BLOCK) * spec["layers"] * probe.cache.layout.bytes_per_block()
    print("| caches | pool MiB | blocks | blocks a sequence holds at most | sequences | most running at once "
          "| preemptions | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for sized in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), compile=CompileOptions("CPU", "f32", "f32"),
                                        kv_cache_size_gb=budget / 2**30, window_sized_caches=sized,
                                        scheduler=SchedulerConfig(max_num_batched_tokens=STEP)), log=lambda m: None)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=args.out, temperature=0, ignore_eos=True))
        most, start = 0, time.perf_counter()
        while engine.has_unfinished_requests:
            engine.step()
            most = max(most, len(engine.scheduler.running))
        print(f"| {'window-sized' if sized else 'every layer every block'} | {engine.cache.nbytes / 2**20:.1f} | "
              f"{engine.blocks.num_blocks} | {engine.blocks.most_held(args.length, STEP)} | {args.sequences} | {most} | "
              f"{engine.scheduler.num_preemptions} | {time.perf_counter() - start:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("bytes", "pool"))
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--pool-sequences", type=int, default=4, help="the pool holds this many full sequences")
    ap.add_argument("--length", type=int, default=4096, help="tokens per sequence, prompt and output")
    ap.add_argument("--out", type=int, default=256)
    args = ap.parse_args()
    (bytes_table if args.mode == "bytes" else pool)(args)


if __name__ == "__main__":
    main()
