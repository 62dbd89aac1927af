"""The sampler alone: one call per setting on Zipf-shaped logits (a language model's next-token
distribution roughly is), medians of alternating calls; with --compare, another version of
sampler.py (e.g. an older commit's) called in turn on the same logits.

    python benchmarks/sampler.py --rows 64 --vocab 49152
    git show 075a600:vinoserve/scheduler/sampler.py > /tmp/old_sampler.py
    python benchmarks/sampler.py --rows 64 --vocab 151936 --compare /tmp/old_sampler.py
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import numpy as np

from vinoserve.scheduler import sampler as current
from vinoserve.scheduler.sampling_params import SamplingParams

SETTINGS = [("greedy", dict(temperature=0.0)), ("temperature 1", dict(temperature=1.0)),
            ("t 0.8, top_p 0.95", dict(temperature=0.8, top_p=0.95)), ("t 0.8, top_k 50", dict(temperature=0.8, top_k=50)),
            ("t 0.7, top_p 0.8, top_k 20", dict(temperature=0.7, top_p=0.8, top_k=20)),
            ("t 1, top_p 0.9, rep 1.1", dict(temperature=1.0, top_p=0.9, repetition_penalty=1.1)),
            ("greedy, logprobs 5", dict(temperature=0.0, logprobs=5)), ("t 1, logprobs 1", dict(temperature=1.0, logprobs=1))]


def load(path: str):
    spec = importlib.util.spec_from_file_location("compared_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def zipf_logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = -2.2 * np.log(np.arange(1, vocab + 1))
    out = np.empty((rows, vocab), np.float32)
    for i in range(rows):
        out[i, rng.permutation(vocab)] = shape + rng.normal(0, 0.3, vocab)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--compare", default=None, help="another sampler.py, called in turn")
    args = ap.parse_args()
    logits = zipf_logits(args.rows, args.vocab)
    modules = {"this": current, **({"compared": load(args.compare)} if args.compare else {})}
    for name, kw in SETTINGS:
        times = {}
        for label, mod in modules.items():
            states = [mod.SamplingState(SamplingParams(max_tokens=16, **kw), list(range(300)), list(range(50)))
                      for _ in range(args.rows)]
            times[label] = (mod.Sampler(), states, [])
        for _ in range(args.calls):
            for sampler, states, spent in times.values():
                start = time.perf_counter()
                sampler.sample(logits, states)
                spent.append(time.perf_counter() - start)
        medians = {label: 1e3 * float(np.median(spent[2:])) for label, (_, _, spent) in times.items()}
        line = "  ".join(f"{label} {ms:7.2f} ms" for label, ms in medians.items())
        ratio = f"  compared / this {medians['compared'] / medians['this']:5.2f}" if args.compare else ""
        print(f"{args.rows} x {args.vocab}  {name:28s} {line}{ratio}")


if __name__ == "__main__":
    main()
