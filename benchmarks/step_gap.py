"""The host time between two overlapped steps: from one step's wait() returning to the next
step's start_async() returning. Nothing computes then, so every microsecond of it is on the
critical path (the rest of the engine's Python runs while a step computes). Split into: the
engine before the sampler, the sampler, the engine before start, and start itself (the
placeholder tokens filled in, then the plugin's start_async()).

    python benchmarks/step_gap.py --seqs 1
    python benchmarks/step_gap.py --seqs 64 --temperature 0.8
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from vinoserve.engine import model_runner
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler import sampler
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

PARTS = ("before sampling", "sampling", "before start", "start")


def timed(marks: dict[str, float]) -> None:
    """Wraps the runner's wait/start and the sampler so that each call records when it returned."""
    def wrap(cls, name: str, enter: str | None, leave: str) -> None:
        inner = getattr(cls, name)

        def call(*args, **kwargs):
            if enter:
                marks[enter] = time.perf_counter()
            out = inner(*args, **kwargs)
            marks[leave] = time.perf_counter()
            return out
        setattr(cls, name, call)
    wrap(model_runner.ModelRunner, "wait", None, "waited")
    wrap(model_runner.ModelRunner, "start", "starting", "started")
    wrap(sampler.Sampler, "sample", "sampling", "sampled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(args.model, scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=256)),
                       log=lambda m: None)
    marks: dict[str, float] = {}
    timed(marks)
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    for i in range(args.seqs):
        engine.add_request(str(i), rng.integers(100, vocab - 100, args.input_len).tolist(),
                           SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature))
    gaps = []
    while engine.has_unfinished_requests:
        marks.clear()
        engine.step()
        order = ("waited", "sampling", "sampled", "starting", "started")
        if all(k in marks for k in order) and marks["waited"] < marks["sampling"] < marks["started"]:
            gaps.append(np.diff([marks[k] for k in order]))
    tail = np.array(gaps[len(gaps) // 3:]) * 1e3  # the decode steps after the prompts
    cells = "  ".join(f"{p} {np.median(tail[:, i]):.3f}" for i, p in enumerate(PARTS))
    print(f"{args.seqs} sequences, {len(tail)} steps, medians in ms: {cells}  "
          f"whole gap {np.median(tail.sum(axis=1)):.3f}")


if __name__ == "__main__":
    main()
