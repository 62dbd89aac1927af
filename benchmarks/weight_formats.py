"""Decode and prefill infer() of one GGUF converted to several weight formats, called in turn.

Each format's conversion is compiled once (the engine's compile_paged, so the load-time passes
run as in serving); every round calls each model the same way, in an order that reverses each
round, and the medians of the per-call times and of the per-round ratios to the first format are
printed. Wall time and process CPU time: on a shared machine CPU time survives preemption.

    python benchmarks/weight_formats.py --model smollm2-135m-instruct --formats auto,int8,f16
    python benchmarks/weight_formats.py --model llama-1.5b-q4_1-random --formats auto,int4 --seqs 1 --prefill 0
    python benchmarks/weight_formats.py --model m.gguf --inference-precision f32 --formats auto,int8
    python benchmarks/weight_formats.py --model llama-1.5b-q4_0-random --formats auto --decode-model --seqs 1,2,3,4
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openvino as ov

from infer_paired import decode_inputs
from vinoserve.bench import random_models
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.spec import read_config
from vinoserve.model.paged import PagedModel, compile_paged
from vinoserve.model.compile_options import CompileOptions


def _prefill(model: PagedModel, tokens: int):
    runner = ModelRunner(model, KVCache(model.layout, model.facts.num_layers, num_blocks=tokens // model.block_size + 2))
    chunk = ScheduledChunk(list(range(100, 100 + tokens)), 0, [list(range(tokens // model.block_size + 1))])
    return lambda: runner.step([chunk])


def _decode(model: PagedModel, seqs: int, context: int, compiled: ov.CompiledModel | None = None):
    compiled = compiled or model.compiled
    inputs = decode_inputs(compiled, model.facts.num_layers, seqs, context)
    request = compiled.create_infer_request()
    cache = KVCache(model.layout, model.facts.num_layers, num_blocks=seqs * (context // 32 + 1) + 1)
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        request.set_tensor(f"key_cache.{layer}", k)
        request.set_tensor(f"value_cache.{layer}", v)

    def call() -> None:
        request.start_async(inputs, share_inputs=True)  # as the runner calls it
        request.wait()
        call.cache = cache  # kept alive with the request
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="built-in name, .gguf file or random model (llama-1.5b-q4_0-random)")
    ap.add_argument("--formats", default="auto,int8,f16")
    ap.add_argument("--seqs", default="1,16", help="decode batch sizes (comma-separated; empty: none)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of one prefill call (0: none)")
    ap.add_argument("--calls", type=int, default=20, help="calls per model per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inference-precision", default=None)
    ap.add_argument("--decode-model", action="store_true",
                    help="also time decode on each format's decode model (model/decode_model.py), forced on: "
                         "its KV cache is then u8 for both")
    args = ap.parse_args()

    core = ov.Core()
    options = CompileOptions(inference_precision=args.inference_precision, decode_model=args.decode_model or None)
    formats = args.formats.split(",")
    models = {}
    for fmt in formats:
        path = resolve_model_dir(random_models.resolve(args.model), fmt, log=print)
        models[fmt] = compile_paged(core.read_model(path / "openvino_model.xml"), options, core,
                                    read_config(path).sliding_windows)
    print(f"{args.model}: compute {models[formats[0]].inference_precision}, {args.rounds} rounds x {args.calls} calls")
    cases = {f"decode {s} seq": {f: _decode(m, int(s), args.context) for f, m in models.items()}
             for s in args.seqs.split(",") if s}
    for s in args.seqs.split(",") if args.decode_model else ():
        cases[f"decode {s} seq"].update({f"{f}+dm": _decode(m, int(s), args.context, m.decode)
                                         for f, m in models.items() if m.decode is not None})
    if args.prefill:
        cases[f"prefill {args.prefill}"] = {f: _prefill(m, args.prefill) for f, m in models.items()}
    for case, calls in cases.items():
        names = list(calls)
        wall = {f: [] for f in names}
        cpu = {f: [] for f in names}
        for f in names:
            calls[f]()  # warm-up
        for r in range(args.rounds):
            for f in names if r % 2 == 0 else names[::-1]:
                w, c = time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    calls[f]()
                wall[f].append((time.perf_counter() - w) / args.calls * 1e3)
                cpu[f].append((time.process_time() - c) / args.calls * 1e3)
        base = names[0]
        for f in names:
            ratio = [b / x for b, x in zip(wall[base], wall[f])]
            print(f"{case:<14} {f:<9} wall {statistics.median(wall[f]):8.2f} ms  cpu {statistics.median(cpu[f]):8.2f} ms"
                  f"  speed / {base}'s: {statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}]",
                  flush=True)

if __name__ == "__main__":
    main()
