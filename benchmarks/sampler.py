"""The sampler alone: one call per setting, medians of alternating calls; with --compare, another
version of sampler.py (e.g. an older commit's) called in turn on the same logits.

Logits are Zipf-shaped (a language model's next-token distribution roughly is), or real ones:
--save-logits runs the default model on real English text, sampling, and keeps the rows of
decode steps that sampled --rows sequences; --logits reads them back. --cold streams 256 MB
through the caches before every call, as a decode step's weights do: in the engine the sampler
runs right after infer(), on caches that hold none of its code or data, and a numpy call then
costs about 5 us more than in a warm loop (that, not the arithmetic, is most of one row's time).

    python benchmarks/sampler.py --rows 64 --vocab 49152
    git show 075a600:vinoserve/scheduler/sampler.py > /tmp/old_sampler.py
    python benchmarks/sampler.py --rows 64 --vocab 151936 --compare /tmp/old_sampler.py
    python benchmarks/sampler.py --rows 64 --save-logits /tmp/real64.npy
    python benchmarks/sampler.py --rows 1 --logits /tmp/real64.npy --cold --compare /tmp/old_sampler.py
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
            ("t 0.7, top_p 0.8, k 20, rep 1.05", dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)),
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


def save_real_logits(path: str, rows: int, steps: int = 12) -> None:
    """Logits of `steps` decode steps that sampled `rows` sequences of real English text, [steps, rows, V]."""
    from vinoserve.bench.engine_vs_genai import real_text_prompts
    from vinoserve.engine.llm import LLM

    kept: list[np.ndarray] = []
    sample = current.Sampler.sample

    def keep(self, logits, states):
        if len(states) == rows and len(kept) < steps:
            kept.append(np.array(logits, dtype=np.float32))
        return sample(self, logits, states)

    current.Sampler.sample = keep
    llm = LLM()
    prompts = real_text_prompts(llm.engine.tokenizer, rows, 256)
    # Long enough that every sequence decodes together for `steps` steps once the last prompt is in.
    llm.generate(prompts, SamplingParams(max_tokens=2 * rows + steps + 8, temperature=0.8, top_p=0.95, seed=1,
                                         ignore_eos=True))
    current.Sampler.sample = sample
    np.save(path, np.stack(kept))
    print(f"saved {len(kept)} steps x {rows} rows to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--compare", default=None, help="another sampler.py, called in turn")
    ap.add_argument("--logits", default=None, help="real logits saved by --save-logits (their vocabulary)")
    ap.add_argument("--save-logits", default=None, help="run the default model and save real logits here")
    ap.add_argument("--cold", action="store_true", help="evict the caches before every call, as a step does")
    ap.add_argument("--prompt-len", type=int, default=300, help="prompt tokens per row (what penalties read)")
    args = ap.parse_args()
    if args.save_logits:
        save_real_logits(args.save_logits, args.rows)
        return
    steps = np.load(args.logits)[:, :args.rows] if args.logits else zipf_logits(args.rows, args.vocab)[None]
    rows, vocab = steps.shape[1:]
    flush = np.ones(256 << 20, dtype=np.uint8) if args.cold else None
    modules = {"this": current, **({"compared": load(args.compare)} if args.compare else {})}
    for name, kw in SETTINGS:
        history = np.random.default_rng(1)
        times = {}
        for label, mod in modules.items():
            states = [mod.SamplingState(SamplingParams(max_tokens=16, **kw), list(history.integers(0, vocab, args.prompt_len)),
                                        list(range(50))) for _ in range(rows)]
            times[label] = (mod.Sampler(), states, [])
        for call in range(args.calls):
            # Who goes first alternates: the first to read a step's logits takes them from memory.
            for sampler, states, spent in list(times.values())[::1 if call % 2 else -1]:
                if flush is not None:
                    np.bitwise_or.reduce(flush[::64])  # one read per cache line
                start = time.perf_counter()
                sampler.sample(steps[call % len(steps)], states)
                spent.append(time.perf_counter() - start)
        medians = {label: 1e3 * float(np.median(spent[2:])) for label, (_, _, spent) in times.items()}
        line = "  ".join(f"{label} {ms:7.2f} ms" for label, ms in medians.items())
        ratio = f"  compared / this {medians['compared'] / medians['this']:5.2f}" if args.compare else ""
        print(f"{rows} x {vocab}  {name:34s} {line}{ratio}")


if __name__ == "__main__":
    main()
