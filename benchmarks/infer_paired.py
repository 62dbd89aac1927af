"""Decode-step infer() of vinoserve's compiled model vs the same IR compiled the way openvino-genai's
ContinuousBatchingPipeline compiles it (its SDPAToPagedAttention flags, its properties), called in
turn in one process. Wall and process CPU time per call: on a shared machine CPU time is what
survives preemption. Optionally a third model from another conversion (e.g. an older converter
version's directory, with per-layer block tables as that version compiled it).

    python benchmarks/infer_paired.py --seqs 1 --calls 40
    python benchmarks/infer_paired.py --seqs 16 --old-ir ~/.cache/vinoserve/converted/SmolLM2-...-f16-v1
    python benchmarks/infer_paired.py --seqs 16 --context 1024 --kv-cache-precisions u8
    python benchmarks/infer_paired.py --seqs 1 --unfused     # ours without the q/k/v fusion too
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import openvino as ov
from openvino._offline_transformations import paged_attention_transformation

from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model import lowbit
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.spec import read_config
from vinoserve.model.paged import _cache_layout, compile_paged
from vinoserve.model.compile_options import CompileOptions


def compiled_models(core: ov.Core, model_dir: Path, old_ir: Path | None,
                    kv_precisions: list[str], unfused: bool = False) -> dict[str, ov.CompiledModel]:
    def ours(options: CompileOptions) -> ov.CompiledModel:
        return compile_paged(core.read_model(model_dir / "openvino_model.xml"), options, core,
                             read_config(model_dir).sliding_windows).compiled

    genai = core.read_model(model_dir / "openvino_model.xml")
    paged_attention_transformation(genai, False, False, True, False, False, False)
    models = {"vinoserve": ours(CompileOptions()), "genai-like": core.compile_model(genai, "CPU", {})}
    if old_ir:
        old = core.read_model(old_ir / "openvino_model.xml")
        paged_attention_transformation(old, True, False, False, False, False, False, False)
        models["old-ir"] = core.compile_model(old, "CPU", CompileOptions().properties())
    for kv in kv_precisions:  # ours again, with another KV cache precision than our default
        models[f"kv {kv}"] = ours(CompileOptions(kv_cache_precision=kv))
    if unfused:
        models["unfused"] = ours(CompileOptions(fuse_projections=False))
    return models


def decode_inputs(compiled: ov.CompiledModel, num_layers: int, seqs: int, context: int) -> dict[str, np.ndarray]:
    """One new token per sequence after `context` cached ones; every input any variant may have."""
    per = context // 32 + 1
    table = np.arange(seqs * per, dtype=np.int32)
    inputs = {"input_ids": np.full(seqs, 100, np.int64), "position_ids": np.full(seqs, context, np.int64),
              "past_lens": np.full(seqs, context, np.int32), "subsequence_begins": np.arange(seqs + 1, dtype=np.int32),
              "max_context_len": np.array(context + 1, np.int32),
              "sampled_token_indices": np.arange(seqs, dtype=np.int64),
              "block_indices_begins": np.arange(0, (seqs + 1) * per, per, dtype=np.int32), "block_indices": table,
              "score_aggregation_window": np.zeros(seqs, np.int32),
              lowbit.PLANES: np.array(ModelRunner.planes([ScheduledChunk([100], context, [[0]], prompt=False)] * seqs),
                                      np.int32),
              **{f"block_indices.{i}": table for i in range(num_layers)}}
    names = {i.get_any_name() for i in compiled.inputs}
    return {k: v for k, v in inputs.items() if k in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--old-ir", type=Path, default=None)
    ap.add_argument("--kv-cache-precisions", default="", help="comma-separated: ours at these KV precisions too")
    ap.add_argument("--unfused", action="store_true", help="ours with q/k/v as separate MatMuls too")
    args = ap.parse_args()
    model_dir = resolve_model_dir(args.model, log=lambda m: None)
    core = ov.Core()
    runs = {}
    for name, compiled in compiled_models(core, model_dir, args.old_ir,
                                                   [p for p in args.kv_cache_precisions.split(",") if p],
                                                   args.unfused).items():
        blocks = args.seqs * (args.context // 32 + 1) + 1
        num_layers = sum(i.get_any_name().startswith("key_cache.") for i in compiled.inputs)
        cache = KVCache(_cache_layout(compiled), num_layers, num_blocks=blocks)
        request = compiled.create_infer_request()
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            request.set_tensor(f"key_cache.{layer}", k)
            request.set_tensor(f"value_cache.{layer}", v)
        runs[name] = (request, decode_inputs(compiled, num_layers, args.seqs, args.context), cache)
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(args.calls):
        for name, (request, inputs, _cache) in runs.items():
            w, c = time.perf_counter(), time.process_time()
            request.start_async(inputs, share_inputs=True)  # as the runner calls it (no output copy)
            request.wait()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    skip = 3  # warm-up calls
    print(f"{model_dir.name}: {args.seqs} sequences, context {args.context}, {args.calls} calls each")
    for name in runs:
        print(f"{name:11s} wall median {np.median(wall[name][skip:]) * 1e3:8.2f} ms   "
              f"CPU median {np.median(cpu[name][skip:]) * 1e3:8.2f} ms")
    for other in (n for n in runs if n != "vinoserve"):
        for label, t in (("CPU", cpu), ("wall", wall)):
            r = np.array(t[other][skip:]) / np.array(t["vinoserve"][skip:])
            print(f"{other} / vinoserve, {label}: median {np.median(r):.3f} "
                  f"[{np.percentile(r, 25):.3f}, {np.percentile(r, 75):.3f}]")


if __name__ == "__main__":
    main()
