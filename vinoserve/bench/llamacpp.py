"""Single-stream decode and prompt speed: llama.cpp (the `xllamacpp` wheel) vs vinoserve, same GGUF.

Each engine runs in a process of its own (`--same-process`: all in this one, as before), one
request at a time, on the same prompt token ids (cut from real English text, tokenized by the
GGUF's own tokenizer), greedy with ignore_eos, prompt caching off on both. Each round runs every engine once, in an order that alternates between rounds, so the
machine's load changes hit all of them alike; the report gives each engine's median tok/s and the
median [25th, 75th percentile] of the per-round ratios against llama.cpp.

Timing is taken the same way for every engine, from outside it: prompt tok/s = prompt tokens /
time to the first token; decode tok/s = (output tokens - 1) / time from the first token to the last.
llama.cpp's own `timings` are printed beside its figures. Beside them, each engine's CPU work: its
process's CPU seconds (all threads) over the same spans, a token. On a machine other jobs share,
wall-clock ratios say little (llama.cpp's threads spin while they wait for a core); with
`--threads 1` the CPU work compares what each engine does for a token, whatever else runs
(`--same-process` mixes every engine's threads into it).

    vinoserve bench llamacpp                                   # SmolLM2 Q4_1: llama.cpp, vinoserve auto, f16
    vinoserve bench llamacpp --input-len 512 --output-len 256 --rounds 7
    vinoserve bench llamacpp --model llama-1.5b-q4_0-random    # a real-size model (random_models.py)
    vinoserve bench llamacpp --model llama-1.5b-q4_0-random,llama-1.5b-q4_k_m-random   # two files, same rounds

From Python (e.g. to put llama.cpp's single stream beside another figure):

    from vinoserve.bench.llamacpp import LlamaCpp
    llama = LlamaCpp("smollm2-135m-instruct")
    print(llama.generate("Once upon a time", max_tokens=128).decode_tok_s)
    llama.close()
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vinoserve.bench import random_models
from vinoserve.bench.read_rate import bound_line, read_rate_gbs
from vinoserve.model import default_model
from vinoserve.model.tokenizer import Tokenizer


@dataclass
class StreamTiming:
    """One request's timing, measured from outside the engine."""
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # request start to first token: the prompt's prefill (and one sampling step)
    decode_s: float  # first token to last
    prompt_cpu_s: float = float("nan")  # the engine process's CPU seconds, all threads, over ttft_s
    decode_cpu_s: float = float("nan")  # and over decode_s

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s if self.output_tokens > 1 else float("nan")

    # llama.cpp's own report of the same request (its `timings`), where the engine gives one
    internal: dict = field(default_factory=dict)

    @property
    def prompt_cpu_ms(self) -> float:
        """CPU milliseconds a prompt token."""
        return 1e3 * self.prompt_cpu_s / self.prompt_tokens

    @property
    def decode_cpu_ms(self) -> float:
        """CPU milliseconds a decoded token."""
        return 1e3 * self.decode_cpu_s / (self.output_tokens - 1) if self.output_tokens > 1 else float("nan")


def _spans(marks: list[tuple[float, float]], prompt_tokens: int, output_tokens: int, internal: dict | None = None) -> StreamTiming:
    """(wall, CPU) at the request's start, then at each token, as a timing."""
    (w0, c0), (w1, c1), (w2, c2) = marks[0], marks[1], marks[-1]
    return StreamTiming(prompt_tokens, output_tokens, w1 - w0, w2 - w1, c1 - c0, c2 - c1, internal or {})


def gguf_path(model: str) -> Path:
    """A built-in model's GGUF (fetched if needed), a random model's (written if needed), or a .gguf path."""
    if model in default_model.BUILTIN_MODELS:
        return default_model.fetch(default_model.BUILTIN_MODELS[model], log=lambda m: None)
    path = Path(random_models.resolve(model)).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"{model!r} is neither a built-in model nor a .gguf file: llama.cpp needs the GGUF")
    return path


class LlamaCpp:
    """llama.cpp's server loop in this process (xllamacpp.Server, no HTTP), one slot."""

    name = "llama.cpp"

    def __init__(self, model: str, threads: int | None = None, n_ctx: int = 4096, n_batch: int = 512) -> None:
        try:
            import xllamacpp
        except ImportError as e:
            raise SystemExit("the llama.cpp comparison needs xllamacpp: pip install 'vinoserve[bench]'") from e
        params = xllamacpp.CommonParams()
        params.model.path = str(gguf_path(model))
        params.n_ctx, params.n_parallel = n_ctx, 1
        params.n_batch = params.n_ubatch = n_batch
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads or os.cpu_count() or 1
        self._server = xllamacpp.Server(params)

    def generate(self, prompt: str | list[int], max_tokens: int) -> StreamTiming:
        marks: list[tuple[float, float]] = []
        last: dict = {}

        def on_chunk(chunk: dict) -> bool:
            marks.append((time.perf_counter(), time.process_time()))
            last.update(chunk)
            return False  # keep going

        request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "cache_prompt": False, "stream": True}
        start = (time.perf_counter(), time.process_time())
        self._server.handle_completions(request, on_chunk)
        if "error" in last or "usage" not in last:
            raise RuntimeError(f"llama.cpp failed: {last}")
        usage = last["usage"]
        # The final chunk carries usage and timings only; each token chunk before it carries text.
        token_marks = marks[:-1] if len(marks) > usage["completion_tokens"] else marks
        return _spans([start, *token_marks], usage["prompt_tokens"], usage["completion_tokens"], last.get("timings"))

    def close(self) -> None:
        del self._server


class Vinoserve:
    """vinoserve's engine in this process, one request at a time, prefix caching off."""

    def __init__(self, model: str, weight_format: str = "auto", max_num_batched_tokens: int = 512,
                 kv_cache_precision: str | None = None, threads: int | None = None,
                 inference_precision: str | None = None, decode_model: str = "auto",
                 dynamic_quantization_group_size: int | None = None, lowbit_kernel: str = "auto") -> None:
        from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
        from vinoserve.model.compile_options import CompileOptions
        from vinoserve.scheduler.scheduler import SchedulerConfig

        self.name = (f"vinoserve {weight_format}" + ("" if decode_model == "auto" else f" dm-{decode_model}")
                     + ("" if dynamic_quantization_group_size is None else f" dq-{dynamic_quantization_group_size}")
                     + ("" if lowbit_kernel == "auto" else f" lk-{lowbit_kernel}"))
        # One stream needs little KV cache; the default (a quarter of free memory) would crowd an 8B pair.
        cfg = EngineConfig(model=model, weight_format=weight_format, enable_prefix_caching=False, kv_cache_size_gb=1.0,
                           speculative=None,  # single-stream decode as such (speculation: bench speculative)
                           compile=CompileOptions(kv_cache_precision=kv_cache_precision, num_threads=threads,
                                                  inference_precision=inference_precision,
                                                  decode_model={"auto": None, "on": True, "off": False}[decode_model],
                                                  lowbit_kernel={"auto": None, "on": True, "off": False}[lowbit_kernel],
                                                  dynamic_quantization_group_size=dynamic_quantization_group_size),
                           scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))
        self.engine = LLMEngine(cfg, log=lambda m: None)
        self._count = 0

    def generate(self, prompt: str | list[int], max_tokens: int) -> StreamTiming:
        from vinoserve.scheduler.sampling_params import SamplingParams

        self._count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        marks = [(time.perf_counter(), time.process_time())]
        ids = self.engine.add_request(f"bench-{self._count}", prompt, params)
        while self.engine.has_unfinished_requests:
            for out in self.engine.step():
                now = (time.perf_counter(), time.process_time())
                marks.extend([now] * len(out.new_token_ids))
        return _spans(marks, len(ids), len(marks) - 1)

    def close(self) -> None:
        del self.engine


class OwnProcess:
    """An engine built and run in a spawned process of its own, driven over a pipe: no engine's
    threads, allocator or caches share a process with another's. The timing is taken in there."""

    def __init__(self, factory, *args) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve_engine, args=(child, factory, args), daemon=True)
        self._process.start()
        self.name = self._call("name")

    def generate(self, prompt: str | list[int], max_tokens: int) -> StreamTiming:
        return self._call("generate", prompt, max_tokens)

    def close(self) -> None:
        self._call("close")
        self._process.join(timeout=60)

    def _call(self, *message):
        self._conn.send(message)
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value


class Deferred:
    """An engine started only when timed, then closed (--one-at-a-time: models too large for two
    engines to hold at once); `name` set before then replaces the engine's own."""

    def __init__(self, start) -> None:
        self._start, self.name = start, None

    def timed(self, run):
        engine = self._start()
        engine.name = self.name = self.name or engine.name
        try:
            return run(engine)
        finally:
            engine.close()


def _serve_engine(conn, factory, args) -> None:
    os.dup2(2, 1)  # the engines' own logs go to stderr: stdout carries the report alone
    try:
        engine = factory(*args)
    except BaseException as e:  # reported to the parent, which raises it
        conn.recv()
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    while True:
        command, *rest = conn.recv()
        try:
            value = engine.name if command == "name" else engine.generate(*rest) if command == "generate" else None
            conn.send((True, value))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))
        if command == "close":
            engine.close()
            return


def real_text_ids(model: str, length: int) -> list[int]:
    """`length` token ids of real English text, by the GGUF's tokenizer (as both engines read it)."""
    from vinoserve.bench.workloads import stdlib_english
    from vinoserve.model.loader import resolve_model_dir

    tokenizer = Tokenizer.from_ir_dir(resolve_model_dir(model, log=lambda m: None))
    ids = tokenizer.encode(stdlib_english(), add_special_tokens=False)
    if len(ids) < length:
        raise SystemExit(f"only {len(ids)} tokens of text; need {length}")
    return ids[:length]


def paired_rounds(engines: list, prompt: str | list[int], max_tokens: int, rounds: int,
                  on_round=None) -> dict[str, list[StreamTiming]]:
    """Every engine once per round; the order is reversed every other round."""
    runs: dict[str, list[StreamTiming]] = {e.name: [] for e in engines}
    for e in engines:  # warm-up: first-call allocations and compilation stay out of the figures
        e.generate(prompt, min(max_tokens, 8))
    for r in range(rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:
            runs[e.name].append(e.generate(prompt, max_tokens))
        if on_round:
            on_round(r, {name: t[-1] for name, t in runs.items()})
    return runs


def _median_iqr(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return f"{q2:.3f} [{q1:.3f}, {q3:.3f}]"


def report(runs: dict[str, list[StreamTiming]], reference: str = LlamaCpp.name) -> list[str]:
    width = max(22, *(len(name) + 2 for name in runs))
    lines = [f"{'engine':<{width}}{'decode tok/s':>14}{'prompt tok/s':>14}{'TTFT ms':>10}"
             f"   decode / {reference}   prompt / {reference}"]
    for name, timings in runs.items():
        decode = statistics.median(t.decode_tok_s for t in timings)
        prompt = statistics.median(t.prompt_tok_s for t in timings)
        ttft = statistics.median(t.ttft_s for t in timings)
        line = f"{name:<{width}}{decode:>14.1f}{prompt:>14.1f}{1e3 * ttft:>10.1f}"
        if name != reference and reference in runs:
            ref = runs[reference]
            line += (f"   {_median_iqr([t.decode_tok_s / r.decode_tok_s for t, r in zip(timings, ref)]):<23} "
                     f"{_median_iqr([t.prompt_tok_s / r.prompt_tok_s for t, r in zip(timings, ref)])}")
        lines.append(line)
    lines.append(f"{'CPU work':<{width}}{'decode ms/tok':>14}{'prompt ms/tok':>14}{'':>10}"
                 f"   {reference} / engine (less work: > 1)")
    for name, timings in runs.items():
        line = (f"{name:<{width}}{statistics.median(t.decode_cpu_ms for t in timings):>14.2f}"
                f"{statistics.median(t.prompt_cpu_ms for t in timings):>14.2f}{'':>10}")
        if name != reference and reference in runs:
            ref = runs[reference]
            line += (f"   {_median_iqr([r.decode_cpu_ms / t.decode_cpu_ms for t, r in zip(timings, ref)]):<23} "
                     f"{_median_iqr([r.prompt_cpu_ms / t.prompt_cpu_ms for t, r in zip(timings, ref)])}")
        lines.append(line)
    if reference in runs and runs[reference][0].internal:
        own = runs[reference]
        lines.append(f"{reference}'s own timings (median): decode "
                     f"{statistics.median(t.internal['predicted_per_second'] for t in own):.1f} tok/s, prompt "
                     f"{statistics.median(t.internal['prompt_per_second'] for t in own):.1f} tok/s")
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=default_model.DEFAULT_MODEL.name,
                    help=f"built-in name, .gguf file, or a random model ({', '.join(random_models.names()[:2])}, ...); "
                         "several, comma-separated, to pair them in one run (they must share a tokenizer)")
    ap.add_argument("--weight-formats", default="auto,f16",
                    help="vinoserve's conversions of the GGUF to compare, the server's default first "
                         "(comma-separated: auto, int4, int8, f16, f32)")
    ap.add_argument("--same-process", action="store_true",
                    help="run every engine in this process (default: each in its own)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start, time and close each engine in turn, not paired (models too large for two at once)")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all CPUs)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="vinoserve's prefill chunk (llama.cpp's n_ubatch is 512)")
    ap.add_argument("--kv-cache-precision", default=None, help="vinoserve's KV cache precision (default: its own)")
    ap.add_argument("--inference-precision", default=None, help="vinoserve's compute precision (default: the CPU's)")
    ap.add_argument("--decode-models", default="auto",
                    help="vinoserve's --decode-model settings to compare, per weight format (comma-separated: auto, on, off)")
    ap.add_argument("--dynamic-quantization-group-sizes", default="default",
                    help="vinoserve's --dynamic-quantization-group-size settings to compare, per weight format and "
                         "decode model (comma-separated: default, 0 for off, 32, ...)")
    ap.add_argument("--ir-models", default="",
                    help="optimum-cli export directories of the --model's shapes, timed by vinoserve beside it on "
                         "the same token ids (comma-separated; one --model)")
    ap.add_argument("--lowbit-kernels", default="auto",
                    help="vinoserve's --lowbit-kernel settings to compare, per weight format and decode model "
                         "(comma-separated: auto, on, off)")


def main(args: argparse.Namespace) -> None:
    models = [str(gguf_path(m)) if m not in default_model.BUILTIN_MODELS else m for m in args.model.split(",") if m]
    if (args.ir_models or args.one_at_a_time) and len(models) > 1:
        raise SystemExit("--ir-models and --one-at-a-time: with one --model")
    prompt = real_text_ids(models[0], args.input_len)
    if any(real_text_ids(m, args.input_len) != prompt for m in models[1:]):
        raise SystemExit("--model: these models tokenize the prompt differently; compare them in separate runs")

    def start(factory, *rest):
        if args.one_at_a_time:
            return Deferred(lambda: start_now(factory, *rest))
        return start_now(factory, *rest)

    def start_now(factory, *rest):
        return factory(*rest) if args.same_process else OwnProcess(factory, *rest)

    groups = [None if g == "default" else int(g) for g in args.dynamic_quantization_group_sizes.split(",")]
    by_model: list[list] = []
    for model in models:
        engines = [start(LlamaCpp, model, args.threads, max(4096, args.input_len + args.output_len + 8))]
        engines += [start(Vinoserve, model, fmt, args.max_num_batched_tokens, args.kv_cache_precision, args.threads,
                          args.inference_precision, dm, dq, lk)
                    for fmt in args.weight_formats.split(",") if fmt for dm in args.decode_models.split(",")
                    for dq in groups for lk in args.lowbit_kernels.split(",")]
        for ir in (p for p in args.ir_models.split(",") if p):
            engines.append(start(Vinoserve, ir, "auto", args.max_num_batched_tokens, args.kv_cache_precision,
                                 args.threads, args.inference_precision))
            engines[-1].name = f"vinoserve [IR {Path(ir).name}]"
        if len(models) > 1:  # one run, several files: each engine named by its file
            for e in engines:
                e.name = f"{e.name} [{gguf_path(model).stem}]"
        by_model.append(engines)
    print(f"{args.model}: 1 stream, {args.input_len} prompt tokens, {args.output_len} out, {args.rounds} "
          f"{'rounds, one engine at a time' if args.one_at_a_time else 'paired rounds'}, {os.cpu_count()} CPUs, "
          f"{'one process' if args.same_process else 'a process per engine'}; "
          f"llama.cpp {', '.join(gguf_path(m).name for m in models)} as is")

    def progress(r: int, last: dict[str, StreamTiming]) -> None:
        print(f"round {r + 1}: " + ", ".join(f"{n} {t.decode_tok_s:.1f}/{t.prompt_tok_s:.0f}" for n, t in last.items())
              + " (decode/prompt tok/s)", flush=True)

    runs = {}
    if args.one_at_a_time:
        for e in (e for engines in by_model for e in engines):
            runs |= e.timed(lambda started: paired_rounds([started], prompt, args.output_len, args.rounds, progress))
    else:
        runs = paired_rounds([e for engines in by_model for e in engines], prompt, args.output_len, args.rounds, progress)
        for engines in by_model:
            for e in engines:
                e.close()
    rate = read_rate_gbs(args.threads)  # with the engines gone: nothing else reads meanwhile
    for model, engines in zip(models, by_model):
        print("\n".join(report({e.name: runs[e.name] for e in engines}, reference=engines[0].name)))
        print(bound_line(gguf_path(model), rate,
                         {e.name: 1e3 / statistics.median(t.decode_tok_s for t in runs[e.name]) for e in engines}))
