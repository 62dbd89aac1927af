"""openvino-genai's ContinuousBatchingPipeline with its own cache eviction, on the benchmark's prompts.

The pipeline opens the same GGUF as vinoserve and is fed the same token ids; its replies are
decoded with vinoserve's tokenizer (the same vocabulary). A row is a spec string:

    full                                  no eviction
    default                               CacheEvictionConfig(32, 128, BUDGET, NORM_SUM): its defaults
                                          (SnapKV window 8, rotation off)
    (KVCrush's blocks come out of BUDGET: it keeps them on top of max_cache_size.)
    window=32,kvcrush=2:alternating,...   its options: aggregation=sum|norm_sum|adaptive_rkv,
                                          window=N, kvcrush=BLOCKS[:ANCHOR], rotation=on|off,
                                          start=N, recent=N, rkv_mass=F

Everything else is the pipeline's default: scheduler (256 tokens a step, split-fuse), the
plugin's precisions for this CPU.
"""
from __future__ import annotations

import numpy as np


def eviction_config(spec: str, budget: int):
    """genai's CacheEvictionConfig for a spec (see the module doc) and a max_cache_size."""
    import openvino_genai as g

    opts = dict(kv.split("=", 1) for kv in spec.split(",") if kv and kv != "default")
    known = {"aggregation", "window", "kvcrush", "rotation", "start", "recent", "rkv_mass"}
    if set(opts) - known:
        raise ValueError(f"unknown genai eviction options {sorted(set(opts) - known)} in {spec!r}")
    mode = getattr(g.AggregationMode, opts.get("aggregation", "norm_sum").upper())
    crush = None
    if "kvcrush" in opts:
        blocks, _, anchor = opts["kvcrush"].partition(":")
        crush = g.KVCrushConfig(int(blocks), getattr(g.KVCrushAnchorPointMode, (anchor or "random").upper()), 0)
        # KVCrush keeps its blocks on top of max_cache_size (genai's docs compare 768 + 8 blocks
        # with 1024): the same memory as the other rows leaves that much less to the rest.
        budget -= int(blocks) * 32
    cfg = g.CacheEvictionConfig(int(opts.get("start", 32)), int(opts.get("recent", 128)), budget, mode,
                                apply_rotation=opts.get("rotation", "off") == "on",
                                snapkv_window_size=int(opts.get("window", 8)), kvcrush_config=crush)
    if "rkv_mass" in opts:
        cfg.adaptive_rkv_config.attention_mass = float(opts["rkv_mass"])
    return cfg


def generate(gguf: str, prompts: list[list[int]], max_tokens: list[int], spec: str, budget: int | None,
             eos_token_ids: tuple[int, ...]) -> list[list[int]]:
    """Greedy replies (token ids) of genai's pipeline, with eviction unless spec is 'full'."""
    import openvino as ov
    import openvino_genai as g

    sched = g.SchedulerConfig()
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    sched.num_kv_blocks = 4 * (-(-longest // 32) + 2)  # up to four long sequences at a time
    if spec != "full":
        sched.use_cache_eviction = True
        sched.cache_eviction_config = eviction_config(spec, budget)
    pipe = g.ContinuousBatchingPipeline(gguf, sched, "CPU", {})
    configs = []
    for m in max_tokens:
        cfg = g.GenerationConfig()
        cfg.max_new_tokens, cfg.do_sample = m, False
        cfg.stop_token_ids = set(eos_token_ids)
        configs.append(cfg)
    results = pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], configs)
    return [list(r.m_generation_ids[0]) for r in results]
