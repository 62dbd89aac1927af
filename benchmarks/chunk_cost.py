"""What one prefill chunk of B tokens costs the decodes it shares a step with.

The compiled model's infer() for a step of D decoding sequences (one token each after `context`
cached tokens) plus one prompt chunk of B tokens, for each B in --chunks (0: decodes only), called
in turn in one process, wall and process CPU time per call. With the budget B, a step that carries
a prefill chunk delays every running stream's next token by step(B) - step(0) (the stall), and the
prompt advances at B / (step(B) - step(0)) tokens/s (the prefill rate a budget buys).

    python benchmarks/chunk_cost.py --decodes 15 --chunks 0,128,256,512,1024,2048 --calls 15
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import openvino as ov

from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model import lowbit
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.spec import read_config
from vinoserve.model.paged import compile_paged
from vinoserve.model.compile_options import CompileOptions


def mixed_step(names: set[str], decodes: int, context: int, chunk: int, block: int) -> tuple[dict, int]:
    """Inputs for D decodes at `context` plus one B-token chunk at the start of its prompt; the
    blocks it needs."""
    lens = [1] * decodes + ([chunk] if chunk else [])
    past = [context] * decodes + ([0] if chunk else [])
    per = [(p + n + block - 1) // block for p, n in zip(past, lens)]
    begins = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    inputs = {"input_ids": np.full(begins[-1], 100, np.int64),
              "position_ids": np.concatenate([np.arange(p, p + n) for p, n in zip(past, lens)]).astype(np.int64),
              "past_lens": np.array(past, np.int32), "subsequence_begins": begins,
              "max_context_len": np.array(max(p + n for p, n in zip(past, lens)), np.int32),
              "sampled_token_indices": (begins[1:] - 1).astype(np.int64),
              "block_indices_begins": np.concatenate([[0], np.cumsum(per)]).astype(np.int32),
              "block_indices": np.arange(sum(per), dtype=np.int32),
              lowbit.PLANES: np.array(ModelRunner.planes([ScheduledChunk([100] * n, p, [[0]], prompt=p == 0)
                                                          for p, n in zip(past, lens)]), np.int32)}
    return {k: v for k, v in inputs.items() if k in names}, sum(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--weight-format", default="f16")
    ap.add_argument("--decodes", type=int, default=15)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--chunks", default="0,128,256,512,1024,2048")
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    model_dir = resolve_model_dir(args.model, args.weight_format, log=lambda m: None)
    core = ov.Core()
    paged = compile_paged(core.read_model(model_dir / "openvino_model.xml"), CompileOptions(), core,
                          read_config(model_dir).sliding_windows)
    names = {i.get_any_name() for i in paged.compiled.inputs}
    chunks = [int(c) for c in args.chunks.split(",")]
    steps = {b: mixed_step(names, args.decodes, args.context, b, paged.block_size) for b in chunks}
    cache = KVCache(paged.layout, paged.facts.num_layers, num_blocks=max(n for _, n in steps.values()) + 1)
    request = paged.compiled.create_infer_request()
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        request.set_tensor(f"key_cache.{layer}", k)
        request.set_tensor(f"value_cache.{layer}", v)
    wall = {b: [] for b in chunks}
    cpu = {b: [] for b in chunks}
    for call in range(args.calls + 2):  # two warm-up rounds
        for b in chunks if call % 2 == 0 else chunks[::-1]:
            w, c = time.perf_counter(), time.process_time()
            request.infer(steps[b][0], share_inputs=True)
            if call >= 2:
                wall[b].append(time.perf_counter() - w)
                cpu[b].append(time.process_time() - c)
    print(f"{model_dir.name}, {paged.inference_precision} inference: {args.decodes} decodes at context "
          f"{args.context} + one prompt chunk of B tokens, {args.calls} calls each, medians")
    print("| B | step wall ms | step CPU ms | stall over decodes-only, wall ms | prefill tok/s (wall) | per prompt token, CPU ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    base_w, base_c = np.median(wall[chunks[0]]), np.median(cpu[chunks[0]])
    for b in chunks:
        w, c = np.median(wall[b]), np.median(cpu[b])
        rate = f"{b / (w - base_w):.0f}" if b else ""
        per = f"{1e3 * (c - base_c) / b:.2f}" if b else ""
        print(f"| {b} | {1e3 * w:.1f} | {1e3 * c:.1f} | {1e3 * (w - base_w):.1f} | {rate} | {per} |")


if __name__ == "__main__":
    main()
