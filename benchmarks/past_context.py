"""Needles in prompts longer than the built-in model's context (8,192 tokens), evicting during
prefill with rotation: positions rebase before they leave the context, so such a prompt runs at all.
Every (prompt, budget) is one request, all queued at once in one engine, answered greedily.

    python benchmarks/past_context.py --lengths 12288,16384 --samples 4 --budgets 1024,2048
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace

from vinoserve.bench.haystack import haystack_text
from vinoserve.bench.longctx import OURS
from vinoserve.bench.longctx_tasks import Generator, score
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="12288,16384")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--budgets", default="1024,2048")
    ap.add_argument("--task", default="niah_single_1")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(cache_eviction=OURS), log=lambda m: None)
    gen = Generator(engine.tokenizer, haystack_text("essays", print), 0)
    samples = [gen.sample(args.task, int(n), "last", i) for n in args.lengths.split(",") for i in range(args.samples)]
    todo = [(s, int(b)) for s in samples for b in args.budgets.split(",")]
    for i, (s, b) in enumerate(todo):
        cfg = replace(OURS, max_cache_size=b, during_prefill=True)
        engine.add_request(str(i), list(s.prompt_ids), SamplingParams(max_tokens=s.max_tokens, temperature=0),
                           cache_eviction=asdict(cfg))
    ids: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        for out in engine.step():
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    scores: dict[tuple[int, int], list[float]] = {}
    for i, (s, b) in enumerate(todo):
        reply = engine.tokenizer.decode(ids[str(i)])
        scores.setdefault((s.length, b), []).append(score(reply, s.answers))
        print(f"{len(s.prompt_ids)} tokens, budget {b}: {s.answers[0]} -> {reply[:40]!r}")
    print(f"\n{len(todo)} requests in {time.perf_counter() - start:.0f} s, "
          f"{engine.evictor.num_rotated_blocks} blocks' worth of keys re-rotated")
    print("| prompt | budget | found |\n| --- | --- | --- |")
    for (length, b), v in sorted(scores.items()):
        print(f"| {length} | {b} | {sum(v):g}/{len(v)} |")


if __name__ == "__main__":
    main()
