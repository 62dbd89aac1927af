"""Where a one-token decode step's time goes, node by node: the plugin's per-node counters
(PERF_COUNT) over steps of one sequence, by op type and kernel, then the matmuls by the type and
shape of their weights (so a GGUF's Q4_K, Q6_K and min-correction products show apart).

    python benchmarks/decode_profile.py --model $(python -m vinoserve.bench.random_models llama-1.5b-q4_0-random)
    python benchmarks/decode_profile.py --model M --decode-model off     # the one compilation on the plugin's kernels
    python benchmarks/decode_profile.py --model M --threads 16

The plugin reports each node's average over every call of an infer request since compiling, and
a compilation that also ran the prompt would carry the prompt chunk into every step's figures
(606 ms of nodes after one step of 145). So the calls of each request are counted, and the
steps' time is each node's total after them (average x calls) less its total before.
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import openvino as ov

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams


class _Profiled(CompileOptions):
    def properties(self) -> dict[str, str]:
        return {**super().properties(), "PERF_COUNT": "YES"}


class _Calls:
    """Counts each infer request's calls (the runner alternates two a compilation)."""

    def __init__(self) -> None:
        self.count: collections.Counter = collections.Counter()
        start = ModelRunner.start

        def counting(runner, step, fill=()):
            self.count[id(step.request)] += 1
            return start(runner, step, fill)
        ModelRunner.start = counting

    def totals(self, requests: list[ov.InferRequest]) -> collections.Counter:
        """Seconds per (node name, type, kernel) over every call so far."""
        total: collections.Counter = collections.Counter()
        for r in requests:
            for info in r.get_profiling_info():
                total[(info.node_name, info.node_type, info.exec_type)] += self.count[id(r)] * info.real_time.total_seconds()
        return total


def _weights(compiled: ov.CompiledModel) -> dict[str, tuple[str, str]]:
    """Node name -> (kernel, its weights' type and shape), for the matmuls of the runtime model."""
    found = {}
    for node in compiled.get_runtime_model().get_ordered_ops():
        info = {k: v.astype(str) for k, v in node.get_rt_info().items()}
        if info.get("layerType") == "Reference" and node.get_input_size() >= 3 \
                and node.input_value(0).get_element_type() == ov.Type.f32:  # vinoserve's kernel (model/lowbit), not its gather
            k = node.input_value(0).get_partial_shape()[-1]  # n: over its outputs (a fused product's parts)
            n = sum(node.get_output_partial_shape(i)[-1].get_length() for i in range(node.get_output_size()))
            size = sum(int(np.prod(list(node.input_value(i).get_partial_shape().to_shape())))
                       * node.input_value(i).get_element_type().size for i in range(1, node.get_input_size())
                       if node.input_value(i).get_partial_shape().is_static)
            found[node.get_friendly_name()] = ("lowbit", f"[{n},{k}], {size / 2**20:.1f} MiB with scales")
        elif info.get("layerType", "").startswith("FullyConnected"):
            weights = node.input_value(1)
            # after the bias (an empty input when there is none): the scales, [rows, groups]
            scales = [node.input_value(i) for i in range(2, node.get_input_size())
                      if node.input_value(i).get_partial_shape().rank.get_length() == 2]
            groups = f", scales {scales[0].get_partial_shape()}" if scales else ""
            found[node.get_friendly_name()] = (info.get("primitiveType", ""), f"{weights.get_element_type().get_type_name()} "
                                               f"{weights.get_partial_shape()}{groups}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--decode-model", default="auto", choices=("auto", "on", "off"),
                    help="off: one compilation, its matmuls on the plugin's kernels")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the profiled steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="the plugin's threads (default: its own)")
    args = ap.parse_args()
    options = _Profiled(decode_model={"auto": None, "on": True, "off": False}[args.decode_model],
                        lowbit_kernel=False if args.decode_model == "off" else None, num_threads=args.threads)
    calls = _Calls()
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_size_gb=0.5, speculative=None, overlap_steps=False,
                                    compile=options), log=print)
    ids = list(range(1000, 1000 + args.context))
    engine.add_request("p", ids, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, temperature=0))
    while not any(o.new_token_ids for o in engine.step()):  # the prompt, in as many chunks as it takes
        pass
    runner, paged = engine.runner, engine.model.paged
    requests = [b.request for b in (runner._decode_inputs or runner._inputs)]
    before, steps, wall = calls.totals(requests), 0, 0.0
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - start
        steps += 1
    nodes = calls.totals(requests)
    nodes.subtract(before)
    by_type: collections.Counter = collections.Counter()
    for (_, kind, kernel), seconds in nodes.items():
        by_type[(kind, kernel)] += seconds
    total = sum(by_type.values())
    print(f"{steps} one-token steps at {args.context} tokens of context: {1e3 * wall / steps:.1f} ms a step "
          f"(engine), {1e3 * total / steps:.1f} ms in the plugin's nodes")
    for (kind, kernel), seconds in by_type.most_common(10):
        print(f"  {kind:26s} {kernel:22s} {1e3 * seconds / steps:7.2f} ms {100 * seconds / total:5.1f}%")
    print("matmuls by weights, a step:")
    weights = _weights(paged.decode or paged.compiled)
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for (name, _, _), seconds in nodes.items():
        if name in weights:
            rows[weights[name]][0] += 1
            rows[weights[name]][1] += seconds / steps
    for (kernel, shape), (count, seconds) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"  {seconds * 1e3:7.2f} ms  {count:3d} x {kernel:22s} {shape}")


if __name__ == "__main__":
    main()
