"""Quality of KV-cache eviction, teacher-forced, on SmolLM2-135M-Instruct.

For each ~2,000-token window of real English text, the engine prefills the first part, then the
true next tokens are fed one decode step at a time (eviction active, exactly as in generation)
and the log-probability the model gave each true token is recorded. Reported: perplexity with
eviction / perplexity with the full cache, per budget, aggregation, rotation on/off, precision;
and the peak KV blocks a sequence held per layer while decoding.

    python benchmarks/eviction_quality.py                    # the table in docs/eviction.md
    python benchmarks/eviction_quality.py --windows 2 --budgets 256   # a quick look
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vinoserve.bench.workloads import stdlib_english
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.paged import CompileOptions
from vinoserve.scheduler.sampler import SamplerOutput
from vinoserve.scheduler.sampling_params import SamplingParams

PRECISIONS = {"f32": CompileOptions(inference_precision="f32", kv_cache_precision="f32"),
              "fast": CompileOptions(inference_precision="bf16", kv_cache_precision="u8")}


def english_text() -> str:
    """The GPL's text (Debian's common-licenses) and the standard library's documentation."""
    gpl = Path("/usr/share/common-licenses/GPL-3")
    return (gpl.read_text() + "\n\n" if gpl.is_file() else "") + stdlib_english()


def text_windows(count: int, length: int) -> tuple[list[list[int]], int]:
    """`count` evenly spread windows of `length` tokens of the text, and how many tokens it has."""
    tok = LLMEngine(EngineConfig(num_kv_blocks=1), log=lambda m: None).tokenizer
    ids = tok.encode(english_text(), add_special_tokens=False)
    stride = (len(ids) - length) // max(1, count - 1)
    return [ids[i * stride:i * stride + length] for i in range(count)], len(ids)


class TeacherForcing:
    """Stands in for the sampler: emits the true next token and records the log-probability
    the model gave it."""

    def __init__(self, targets: dict[int, list[int]]) -> None:
        self.targets = targets  # keyed by id() of the request's prompt list
        self.logprobs: dict[int, list[float]] = {k: [] for k in targets}

    def sample(self, logits: np.ndarray, rows) -> SamplerOutput:
        tokens = []
        for row, state in zip(logits.astype(np.float64), rows):
            key = id(state.prompt_token_ids)
            true = self.targets[key][len(state.output_token_ids)]
            z = row - row.max()
            self.logprobs[key].append(float(z[true] - np.log(np.exp(z).sum())))
            tokens.append(true)
        n = len(tokens)
        return SamplerOutput(np.array(tokens, dtype=np.int64), np.full(n, np.nan, np.float32), [None] * n)


@dataclass
class Result:
    perplexity: float
    peak_blocks: int


def run(windows: list[list[int]], prefill: int, options: CompileOptions, eviction: CacheEvictionConfig | None) -> Result:
    engine = LLMEngine(EngineConfig(compile=options, cache_eviction=eviction, num_kv_blocks=len(windows) * 80),
                       log=lambda m: None)
    prompts = [w[:prefill] for w in windows]
    teacher = TeacherForcing({id(p): w[prefill:] for p, w in zip(prompts, windows)})
    engine.sampler = teacher
    steps = len(windows[0]) - prefill
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, SamplingParams(max_tokens=steps, ignore_eos=True))
    # add_request copies the prompt into the sequence: re-key the teacher by the engine's lists.
    teacher.targets = {id(r.seq.prompt_token_ids): teacher.targets[id(p)]
                       for r, p in zip(engine._requests.values(), prompts)}
    teacher.logprobs = {k: [] for k in teacher.targets}
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        # Prefill holds the whole prompt (no eviction there); what eviction bounds is decode.
        peak = max([peak] + [len(r.seq.block_tables[0]) for r in engine._requests.values()
                             if r.seq.num_computed_tokens > len(r.seq.prompt_token_ids)])
    nll = -np.mean([lp for lps in teacher.logprobs.values() for lp in lps])
    return Result(math.exp(nll), peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=2000)
    ap.add_argument("--forced", type=int, default=256, help="true tokens fed one decode step at a time")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--precisions", default="f32,fast")
    args = ap.parse_args()

    windows, available = text_windows(args.windows, args.window_len)
    prefill = args.window_len - args.forced
    print(f"SmolLM2-135M-Instruct, {args.windows} windows x {args.window_len} tokens of English text "
          f"({available} available), prefill {prefill}, {args.forced} teacher-forced decode steps, "
          f"start {args.start} recent {args.recent}\n")
    print("| precision | budget | aggregation | rotation | perplexity | ratio to full | peak blocks/layer in decode |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.precisions.split(","):
        options = PRECISIONS[name]
        start = time.perf_counter()
        full = run(windows, prefill, options, None)
        print(f"| {name} | full | - | - | {full.perplexity:.3f} | 1.000 | {full.peak_blocks} |", flush=True)
        for budget, agg, rot in itertools.product(map(int, args.budgets.split(",")), ("norm_sum", "sum"),
                                                  (True, False)):
            cfg = CacheEvictionConfig(args.start, args.recent, budget, aggregation=agg, rotation=rot)
            r = run(windows, prefill, options, cfg)
            print(f"| {name} | {budget} | {agg} | {'on' if rot else 'off'} | {r.perplexity:.3f} | "
                  f"{r.perplexity / full.perplexity:.3f} | {r.peak_blocks} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - start:.0f} s -->")


if __name__ == "__main__":
    main()
