"""Where a one-token decode step's time goes, node by node: the plugin's per-node counters
(PERF_COUNT) summed over steps of one sequence, by op type and kernel, then the matmuls by the
type and shape of their weights (so a GGUF's Q4_K, Q6_K and min-correction products show apart).

    python benchmarks/decode_profile.py --model $(python -m vinoserve.bench.random_models llama-1.5b-q4_0-random)
    python benchmarks/decode_profile.py --model M --decode-model off     # the one compilation alone

The plugin reports each node's average over every call since compiling, so a compilation that
also ran the prompt would carry the prompt chunk into every step's figures (606 ms of nodes
after one step of 145). With `--decode-model off` the steps therefore run on a second compilation
identical to the main one (same properties, same cache), which never sees the prompt.
"""
from __future__ import annotations

import argparse
import collections
import time
from dataclasses import replace

import numpy as np

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model import cpu_defaults, decode_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams


class _Profiled(CompileOptions):
    def properties(self) -> dict[str, str]:
        return {**super().properties(), "PERF_COUNT": "YES"}


def _matmul_rows(compiled) -> dict[tuple[str, str], list[float]]:
    """[nodes, microseconds of the last call] per (kernel, weight type and shape), from the runtime model."""
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for node in compiled.get_runtime_model().get_ordered_ops():
        info = {k: v.astype(str) for k, v in node.get_rt_info().items()}
        if info.get("layerType") == "Reference" and node.get_input_size() >= 3:  # vinoserve's kernel (model/lowbit)
            k, n = node.input_value(0).get_partial_shape()[-1], node.get_output_partial_shape(0)[-1]
            size = sum(int(np.prod(list(node.input_value(i).get_partial_shape().to_shape())))
                       * node.input_value(i).get_element_type().size for i in range(1, node.get_input_size()))
            key = ("lowbit", f"[{n},{k}], {size / 2**20:.1f} MiB with scales")
            rows[key][0] += 1
            rows[key][1] += float(info.get("execTimeMcs", 0))
            continue
        if not info.get("layerType", "").startswith("FullyConnected"):
            continue
        weights = node.input_value(1)
        # after the bias (an empty input when there is none): the scales, [rows, groups]
        scales = [node.input_value(i) for i in range(2, node.get_input_size())
                  if node.input_value(i).get_partial_shape().rank.get_length() == 2]
        groups = f", scales {scales[0].get_partial_shape()}" if scales else ""
        key = (info.get("primitiveType", ""), f"{weights.get_element_type().get_type_name()} "
               f"{weights.get_partial_shape()}{groups}")
        rows[key][0] += 1
        rows[key][1] += float(info.get("execTimeMcs", 0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--decode-model", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the profiled steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="the plugin's threads (default: its own)")
    args = ap.parse_args()
    if args.decode_model == "off":  # a "decode model" that is the main compilation again
        decode_model.properties = lambda main: main
        row = cpu_defaults.DEFAULTS[cpu_defaults.this_cpu()]
        decode_model.with_shared_cache = lambda options: replace(
            options, decode_model=True, kv_cache_precision=options.kv_cache_precision or row.kv_cache_precision)
    options = _Profiled(decode_model={"auto": None, "on": True, "off": True}[args.decode_model],
                        lowbit_kernel=False if args.decode_model == "off" else None, num_threads=args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_size_gb=0.5, speculative=None, overlap_steps=False,
                                    compile=options), log=print)
    ids = list(range(1000, 1000 + args.context))
    engine.add_request("warm", ids, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    while engine.has_unfinished_requests:
        engine.step()
    engine.add_request("p", ids, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, temperature=0))
    engine.step()  # the prompt
    runner, paged = engine.runner, engine.model.paged
    bound = runner._decode_inputs or runner._inputs
    by_type: collections.Counter = collections.Counter()
    steps, wall = 0, 0.0
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - start
        for info in bound[0].request.get_profiling_info():
            by_type[(info.node_type, info.exec_type)] += info.real_time.total_seconds()
        steps += 1
    total = sum(by_type.values())
    print(f"{steps} one-token steps at {args.context} tokens of context: {1e3 * wall / steps:.1f} ms a step "
          f"(engine), {1e3 * total / steps:.1f} ms in the plugin's nodes")
    for (kind, kernel), seconds in by_type.most_common(10):
        print(f"  {kind:26s} {kernel:22s} {1e3 * seconds / steps:7.2f} ms {100 * seconds / total:5.1f}%")
    print("matmuls by weights (the last step):")
    rows = _matmul_rows(paged.decode or paged.compiled)
    for (kernel, weights), (nodes, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us / 1e3:7.2f} ms  {nodes:3d} x {kernel:22s} {weights}")


if __name__ == "__main__":
    main()
