"""A draft model against no speculation, single stream, paired in one process: SmolLM2 (f16 by
default) with its own int8 conversion drafting, on a copying prompt and a free-writing prompt;
the two engines alternate request by request, each measurement repeated. Prints tok/s of both,
the ratio, and the acceptance figures.

    python benchmarks/speculative_draft.py --repeats 3 --out 128
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from speculative import copy_prompts, run
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.paged import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams

FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=int, default=128, help="max tokens per request")
    ap.add_argument("--weight-format", default="f16", help="the target's weights")
    ap.add_argument("--draft-weight-format", default="int8")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--inference-precision", default=None)
    args = ap.parse_args()

    base = EngineConfig(weight_format=args.weight_format, kv_cache_size_gb=0.5, enable_prefix_caching=False,
                        compile=CompileOptions(inference_precision=args.inference_precision))
    spec = SpeculativeConfig(method="draft_model", model="smollm2-135m-instruct",
                             weight_format=args.draft_weight_format, num_speculative_tokens=args.k)
    engines = {"plain": LLMEngine(base, log=lambda m: None),
               "draft": LLMEngine(replace(base, speculative=spec), log=lambda m: None)}
    tok = engines["plain"].tokenizer
    workloads = {"copy": copy_prompts(engines["plain"], 1, 1500),
                 "free": [tok.encode(tok.apply_chat_template([{"role": "user", "content": FREE}]),
                                     add_special_tokens=False)]}
    params = SamplingParams(max_tokens=args.out, temperature=0)
    print(f"target {args.weight_format}, draft {args.draft_weight_format}, k={args.k}, {args.out} tokens, 1 stream")
    for name, prompts in workloads.items():
        for engine in engines.values():  # warm up
            run(engine, prompts, replace(params, max_tokens=4))
        rates: dict[str, list[float]] = {"plain": [], "draft": []}
        before = replace(engines["draft"].speculator.stats)
        tokens = {}
        for _ in range(args.repeats):
            for label, engine in engines.items():
                seconds, tokens[label] = run(engine, prompts, params)
                rates[label].append(tokens[label] / seconds)
        s = engines["draft"].speculator.stats
        drafts, proposed, accepted = (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                                      s.num_accepted_tokens - before.num_accepted_tokens)
        ratios = [a / b for a, b in zip(rates["draft"], rates["plain"])]
        print(f"{name}: plain {statistics.median(rates['plain']):.1f} tok/s, draft {statistics.median(rates['draft']):.1f}"
              f" tok/s, ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]; "
              f"{tokens['draft']} tokens/run; proposals {drafts}, tokens proposed {proposed}, accepted {accepted} "
              f"({accepted / max(proposed, 1):.0%}), mean acceptance length {1 + accepted / max(drafts, 1):.2f}")


if __name__ == "__main__":
    main()
