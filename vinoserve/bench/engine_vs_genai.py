"""vinoserve's engine vs openvino-genai's C++ ContinuousBatchingPipeline, back to back.

Same converted model directory, same token-id prompts (real English text), same scheduler budget,
ignore_eos, greedy unless --temperature (with --top-p / --top-k) makes both engines sample, the
device's default precisions unless --inference-precision / --kv-cache-precision set them (for both
engines). Prints generated tok/s of both and their ratio,
each engine's effective inference precision and KV cache type, vinoserve's mean step time and the
Python share of it (time outside infer()). With --repeats N both engines are built once and run
in turn N times; figures are medians and the ratio is the median of the N paired ratios.

    vinoserve bench engine                          # SmolLM2, 64 x (256 in, 128 out)
    vinoserve bench engine --prompts 1 --repeats 7  # single stream, paired runs
    vinoserve bench engine --model qwen2-0.5b-random --prompts 16 --input-len 128
    vinoserve bench engine --prompts 1 --kv-cache-precision bf16
    vinoserve bench engine --prompts 64 --temperature 0.8 --top-p 0.95   # sampled, as chat traffic is
    vinoserve bench engine --prompts 16 --input-len 2048 --temperature 0.7 --top-p 0.8 --top-k 20 \
        --repetition-penalty 1.05                                          # Qwen's defaults, long prompts
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vinoserve.bench import random_models
from vinoserve.bench.workloads import stdlib_english
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.loader import resolve_model_dir
from vinoserve.model.compile_options import KV_PRECISIONS, PRECISIONS, CompileOptions
from vinoserve.model.storage import cache_root
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.model.weights import WEIGHT_FORMATS
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

QWEN2_05B = dict(layers=24, hidden=896, heads=14, kv_heads=2, ffn=4864, vocab=151936, theta=1000000.0)


@dataclass(frozen=True)
class Sampling:
    """The token choice both engines make: greedy at temperature 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    repetition_penalty: float = 1.0  # greedy or sampled, as in both engines

    def params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed + seed_offset if self.temperature else None,
                              repetition_penalty=self.repetition_penalty, ignore_eos=True)

    def genai_config(self, max_tokens: int):
        import openvino_genai as genai

        cfg = genai.GenerationConfig()
        cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = max_tokens, True, self.temperature > 0
        cfg.repetition_penalty = self.repetition_penalty
        if self.temperature > 0:
            cfg.temperature, cfg.top_p, cfg.rng_seed = self.temperature, self.top_p, self.seed
            if self.top_k:
                cfg.top_k = self.top_k
        return cfg


def real_text_prompts(tokenizer: Tokenizer, count: int, length: int, distinct_head: int = 32) -> list[list[int]]:
    """Prompts of exactly `length` tokens cut from real English text, spread evenly over it, no two
    starting with the same `distinct_head` tokens (a prefix-cache block): text that says a thing
    twice would otherwise hand two "fresh" prompts a shared first block."""
    ids = tokenizer.encode(stdlib_english(), add_special_tokens=False)
    stride = max(1, (len(ids) - length) // count)
    if len(ids) < length + count:
        raise SystemExit(f"only {len(ids)} tokens of text; need {length + count}")
    prompts, heads = [], set()
    for i in range(count):
        start = i * stride
        while tuple(ids[start:start + distinct_head]) in heads and start + length < len(ids):
            start += 1
        heads.add(tuple(ids[start:start + distinct_head]))
        prompts.append(ids[start:start + length])
    return prompts


def random_qwen2_gguf(path: Path, s: dict) -> Path:
    """A Qwen2-0.5B-shaped GGUF with random f16 weights (the architecture's cost, not its quality)."""
    import gguf

    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path) + ".part", "qwen2")
    for key, val in [("block_count", s["layers"]), ("context_length", 32768), ("embedding_length", s["hidden"]),
                     ("feed_forward_length", s["ffn"]), ("head_count", s["heads"]), ("head_count_kv", s["kv_heads"]),
                     ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", s["theta"]), ("vocab_size", s["vocab"])]:
        getattr(w, f"add_{key}")(val)
    byte_tokens = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(256, 256 + 162)]
    tokens = byte_tokens + ["ab"] + [f"[tok{i}]" for i in range(s["vocab"] - len(byte_tokens) - 2)] + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(len(tokens) - 1)
    hd = s["hidden"] // s["heads"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(s["vocab"], s["hidden"]))
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], np.float32))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, shape in [("attn_q", (s["hidden"], s["hidden"])), ("attn_k", (s["kv_heads"] * hd, s["hidden"])),
                            ("attn_v", (s["kv_heads"] * hd, s["hidden"])), ("attn_output", (s["hidden"], s["hidden"])),
                            ("ffn_gate", (s["ffn"], s["hidden"])), ("ffn_up", (s["ffn"], s["hidden"])),
                            ("ffn_down", (s["hidden"], s["ffn"]))]:
            w.add_tensor(p + name + ".weight", mat(*shape))
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(p + name + ".bias", np.zeros(s["hidden"] if name == "attn_q" else s["kv_heads"] * hd, np.float32))
        w.add_tensor(p + "attn_norm.weight", np.ones(s["hidden"], np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(s["hidden"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.rename(str(path) + ".part", path)
    return path


def vinoserve_runner(model_dir: Path, warm_up, out_len: int, blocks: int, budget: int,
                     precision: CompileOptions, overlap: bool = True,
                     sampling: Sampling = Sampling()) -> Callable[[list], dict]:
    """Builds and warms vinoserve's engine once; each call of the result is one timed run."""
    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=blocks, compile=precision, overlap_steps=overlap,
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget))
    llm = LLM(cfg, log=lambda m: None)
    llm.generate(warm_up, sampling.params(4))
    engine, runner = llm.engine, llm.engine.runner

    def run(prompts: list) -> dict:
        steps0, step_s0, infer_s0 = engine.stats.num_steps, engine.stats.step_seconds, runner.infer_seconds
        hidden_s0 = engine.stats.overlapped_seconds
        hits0 = _prefix_hits(engine)
        start = time.perf_counter()
        results = llm.generate(prompts, [sampling.params(out_len, i) for i in range(len(prompts))])
        elapsed = time.perf_counter() - start
        assert all(len(r.token_ids) == out_len for r in results)
        # Prompts are fresh each run: genai caches no prefixes by default, so neither may we here.
        assert _prefix_hits(engine) == hits0, "prefix cache hit"
        steps = engine.stats.num_steps - steps0
        step_s = engine.stats.step_seconds - step_s0
        python_s = step_s - (runner.infer_seconds - infer_s0)
        hidden_s = engine.stats.overlapped_seconds - hidden_s0
        return dict(seconds=elapsed, tok_s=len(prompts) * out_len / elapsed, steps=steps,
                    step_ms=1e3 * step_s / steps, python_ms=1e3 * python_s / steps, hidden_ms=1e3 * hidden_s / steps,
                    precision=engine.model.paged.inference_precision, kv=_kv_name(engine.model.paged.layout),
                    fused=engine.model.paged.options.fuse_projections, overlap=overlap)

    return run


def _prefix_hits(engine) -> int:
    return engine.blocks.prefix.num_hit_tokens if engine.blocks.prefix else 0


def _kv_name(layout) -> str:
    k, v = layout.key_type.get_type_name(), layout.value_type.get_type_name()
    return k if k == v else f"{k} key / {v} value"


def _genai_pipeline(model_dir: Path, sched, properties: dict):
    """The pipeline, and the properties its compiled LLM reports. genai exposes no compiled model;
    with OPENVINO_LOG_LEVEL above WARNING its constructor prints each compiled model's effective
    properties to stdout, which is captured here at the file-descriptor level."""
    import openvino_genai as genai

    sys.stdout.flush()
    saved_fd, saved_level = os.dup(1), os.environ.get("OPENVINO_LOG_LEVEL")
    os.environ["OPENVINO_LOG_LEVEL"] = "3"
    with tempfile.TemporaryFile(mode="w+") as out:
        os.dup2(out.fileno(), 1)
        try:
            pipe = genai.ContinuousBatchingPipeline(str(model_dir), sched, "CPU", properties)
        finally:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            if saved_level is None:
                del os.environ["OPENVINO_LOG_LEVEL"]
            else:
                os.environ["OPENVINO_LOG_LEVEL"] = saved_level
        out.seek(0)
        printed = out.read()
    llm = printed.split("Model: LLM with Paged Attention", 1)[-1]
    pairs = (line.strip().partition(": ") for line in llm.splitlines() if line.startswith("  "))
    return pipe, {key: value for key, sep, value in pairs if sep}


def genai_runner(model_dir: Path, warm_up, out_len: int, blocks: int, budget: int,
                 precision: CompileOptions, sampling: Sampling = Sampling()) -> Callable[[list], dict]:
    """Builds and warms genai's pipeline once; each call of the result is one timed run."""
    import openvino as ov
    import openvino_genai as genai

    sched = genai.SchedulerConfig()
    sched.num_kv_blocks, sched.max_num_batched_tokens, sched.max_num_seqs = blocks, budget, 256
    properties = {k: v for k, v in precision.properties().items() if k != "NUM_STREAMS"}
    pipe, effective = _genai_pipeline(model_dir, sched, properties)
    cfg, warm = sampling.genai_config(out_len), sampling.genai_config(4)
    pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in warm_up], [warm] * len(warm_up))
    k, v = effective.get("KEY_CACHE_PRECISION", "?"), effective.get("VALUE_CACHE_PRECISION", "?")

    def run(prompts: list) -> dict:
        tensors = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        start = time.perf_counter()
        results = pipe.generate(tensors, [cfg] * len(tensors))
        elapsed = time.perf_counter() - start
        assert all(len(r.m_generation_ids[0]) == out_len for r in results)
        return dict(seconds=elapsed, tok_s=len(prompts) * out_len / elapsed,
                    precision=effective.get("INFERENCE_PRECISION_HINT", "?"), kv=k if k == v else f"{k} key / {v} value")

    return run


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="built-in name, .gguf, IR dir, 'qwen2-0.5b-random', or a Llama-shaped random "
                         "model (llama-1.5b-q4_0-random, ...: vinoserve/bench/random_models.py)")
    ap.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--only", choices=("vinoserve", "genai"), default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per engine, alternating; the ratio is the median of paired runs")
    ap.add_argument("--inference-precision", choices=PRECISIONS, default=None,
                    help="for both engines (default: the plugin's choice for this CPU)")
    ap.add_argument("--kv-cache-precision", choices=KV_PRECISIONS, default=None,
                    help="for both engines (default: the plugin's choice for this CPU)")
    ap.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                    help="vinoserve's q/k/v as one MatMul (default: where the CPU plugin does not fuse them itself)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="both engines sample at this temperature (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature, for both engines")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature, for both engines (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="with --temperature: each engine's sampling seed")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="for both engines, over each sequence's prompt and output (default 1: off)")
    ap.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="vinoserve sets up each step while the one before computes (default: on)")


def main(args: argparse.Namespace) -> None:
    model = args.model
    if model == "qwen2-0.5b-random":
        bench_dir = cache_root() / "bench"
        bench_dir.mkdir(parents=True, exist_ok=True)
        model = str(random_qwen2_gguf(bench_dir / "qwen2-0.5b-random.gguf", QWEN2_05B))
    model_dir = resolve_model_dir(random_models.resolve(model), args.weight_format)
    tokenizer = Tokenizer.from_ir_dir(model_dir)
    # Distinct prompts for the warm-up and for every run: a repeated prompt would be a prefix-cache
    # hit for vinoserve (on by default) and not for genai (off by default).
    count = args.prompts * args.repeats + 2
    if args.model == "qwen2-0.5b-random":
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, QWEN2_05B["vocab"] - 1, (count, args.input_len)).tolist()
    else:
        prompts = real_text_prompts(tokenizer, count, args.input_len)
    warm_up, per_run = prompts[-2:], [prompts[r * args.prompts:(r + 1) * args.prompts] for r in range(args.repeats)]
    # Enough KV for every sequence at full length, so neither engine preempts.
    blocks = args.prompts * math.ceil((args.input_len + args.output_len) / 32) + 8

    print(f"model {model_dir.name}: {args.prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, {os.cpu_count()} CPUs, "
          + (f"sampled at temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k or 'off'}"
             if args.temperature else "greedy")
          + (f", repetition_penalty {args.repetition_penalty}" if args.repetition_penalty != 1.0 else ""))
    precision = CompileOptions(inference_precision=args.inference_precision,
                               kv_cache_precision=args.kv_cache_precision, fuse_projections=args.fuse_projections)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed, args.repetition_penalty)
    runners = {}
    if args.only != "genai":
        runners["vinoserve"] = vinoserve_runner(model_dir, warm_up, args.output_len, blocks,
                                                args.max_num_batched_tokens, precision, args.overlap_steps, sampling)
    if args.only != "vinoserve":
        runners["genai"] = genai_runner(model_dir, warm_up, args.output_len, blocks, args.max_num_batched_tokens,
                                        precision, sampling)
    runs = {name: [] for name in runners}
    for r, prompts in enumerate(per_run):  # in turn, so both engines see the same machine load and prompts;
        order = list(runners.items())        # who goes first alternates, so neither always follows the other
        for name, run in order[::-1] if r % 2 else order:
            runs[name].append(run(prompts))
    if "vinoserve" in runs:
        r = runs["vinoserve"]
        hidden = f" ({_median(r, 'hidden_ms'):.2f} of it while a step computes)" if r[0]["overlap"] else ""
        print(f"vinoserve      {_median(r, 'tok_s'):8.1f} generated tok/s  ({_median(r, 'seconds'):.2f} s, "
              f"{r[0]['steps']} steps, mean step {_median(r, 'step_ms'):.1f} ms, "
              f"Python outside infer {_median(r, 'python_ms'):.2f} ms/step"
              f"{hidden}, "
              f"{r[0]['precision']} inference, {r[0]['kv']} KV{', q/k/v fused' if r[0]['fused'] else ''})")
    if "genai" in runs:
        r = runs["genai"]
        print(f"openvino-genai {_median(r, 'tok_s'):8.1f} generated tok/s  ({_median(r, 'seconds'):.2f} s, "
              f"{r[0]['precision']} inference, {r[0]['kv']} KV)")
    if len(runs) == 2:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["vinoserve"], runs["genai"])]
        if len(ratios) > 1:
            print("paired ratios: " + " ".join(f"{x:.3f}" for x in ratios))
        print(f"ratio vinoserve / genai: {float(np.median(ratios)):.3f}")


def _median(runs: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in runs]))
