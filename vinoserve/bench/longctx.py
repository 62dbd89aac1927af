"""`vinoserve bench longctx`: what cache eviction loses on long-context retrieval, against the full
cache, a start + recent baseline and openvino-genai's own eviction, on identical token ids.

Prompts come from longctx_tasks (RULER-style, generated offline with a fixed seed). Every row
answers the same prompts greedily; a row's score at a budget is retained = its mean task score /
the full cache's mean task score (its own engine's full cache), over the tasks where vinoserve's
full cache scores >= 50% (a 135M model fails some tasks outright; losing nothing there measures
nothing). vinoserve's rows share one prefill per prompt (forked_prefill); genai's pipeline
prefills each prompt once per row and budget. Replies are cached per row and prompt under
~/.cache/vinoserve/bench/longctx, so an interrupted or extended run computes only what is new.

    vinoserve bench longctx --quick                        # seconds: 2 tasks at 1K, one sample
    vinoserve bench longctx                                # 4K, question last, the issue's rows
    vinoserve bench longctx --lengths 4096,8192 --placements last,first --samples 3
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from vinoserve.bench.haystack import HAYSTACKS, haystack_text
from vinoserve.bench.longctx_tasks import PLACEMENTS, SINGLE_NEEDLE_TASKS, TASKS, Generator, Sample, score
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.storage import cache_root

# What `ours` means: the policy the benchmark chose, as `--cache-eviction 32,64,MAX` runs it: start
# 32, recent 64 (recent 128 kept 9 points less at 256 and 6 at 512: docs/eviction.md).
OURS = CacheEvictionConfig.parse("32,64,672")
# The rows, by name: ours and its ablations, the baselines and genai's pipeline.
OUR_ROWS = {
    "ours": OURS,
    "ours-no-rotation": replace(OURS, rotation=False),
    "blocks": CacheEvictionConfig(policy="blocks"),  # vinoserve before: genai's policy, rotated
    "blocks-no-rotation": CacheEvictionConfig(policy="blocks", rotation=False),
    "streaming": CacheEvictionConfig(policy="streaming"),
    "ours-prefill": replace(OURS, during_prefill=True),  # evicting after every prompt chunk too
}
GENAI_ROWS = {"genai": "default", "genai-best": "window=32,kvcrush=2:alternating"}
DEFAULT_ROWS = "ours,ours-no-rotation,streaming,blocks,genai,genai-best"


@dataclass(frozen=True)
class Row:
    name: str
    budget: int | None  # None: the full cache
    setting: CacheEvictionConfig | str | None  # ours: a config; genai: its spec

    @property
    def engine(self) -> str:
        return "genai" if isinstance(self.setting, str) else "vinoserve"

    @property
    def cache_name(self) -> str:
        if self.setting is None or self.setting == "full":
            return f"{self.engine}-full"
        if isinstance(self.setting, str):  # genai's spec names no budget
            return f"genai-{self.setting},budget={self.budget}"
        return f"vinoserve-{setting_name(self.setting)}"


def setting_name(cfg: CacheEvictionConfig) -> str:
    """Every field, sorted: the name stays put when a field is added with a default (old names then
    miss it); `during_prefill` only where it is on (names from before it existed stay valid)."""
    fields = {k: v for k, v in asdict(cfg).items() if k != "during_prefill" or v}
    return ",".join(f"{k}={v}" for k, v in sorted(fields.items()))


def our_setting(base: CacheEvictionConfig, budget: int, overrides: str = "") -> CacheEvictionConfig:
    """A row's config at a budget, with `overrides` ('key=value,...') of its fields."""
    cfg = replace(base, max_cache_size=budget)
    for kv in filter(None, overrides.split(",")):
        key, _, value = kv.partition("=")
        kind = type(getattr(cfg, key))
        cfg = replace(cfg, **{key: value in ("1", "true", "on") if kind is bool else kind(value)})
    return cfg


class ResultCache:
    """Replies per (row setting, sample), one JSON-lines file per setting."""

    def __init__(self, root: Path, tag: str) -> None:
        self.dir = root / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self._loaded: dict[str, dict[str, str]] = {}

    def _file(self, name: str) -> Path:
        import hashlib

        return self.dir / (hashlib.sha256(name.encode()).hexdigest()[:20] + ".jsonl")

    def get(self, name: str) -> dict[str, str]:
        if name not in self._loaded:
            f, got = self._file(name), {}
            if f.is_file():
                for line in f.read_text().splitlines():
                    rec = json.loads(line)
                    got[rec["sample"]] = rec["reply"]
            self._loaded[name] = got
        return self._loaded[name]

    def put(self, name: str, sample: Sample, reply: str) -> None:
        self.get(name)[sample.key] = reply
        with self._file(name).open("a") as f:
            f.write(json.dumps({"setting": name, "sample": sample.key, "reply": reply}) + "\n")


def run_ours(samples: list[Sample], rows: list[Row], cache: ResultCache, options: CompileOptions, log) -> None:
    """Every vinoserve row's replies, one prefill per prompt for all of them (rows that evict during
    prefill compute their own prompts, in the engine's step loop)."""
    from vinoserve.bench.forked_prefill import ForkedPrefill
    from vinoserve.engine.llm_engine import EngineConfig, LLMEngine

    streamed = [r for r in rows if isinstance(r.setting, CacheEvictionConfig) and r.setting.during_prefill]
    if streamed:
        run_streamed(samples, streamed, cache, options, log)
        rows = [r for r in rows if r not in streamed]
    todo = [(s, [r for r in rows if s.key not in cache.get(r.cache_name)]) for s in samples]
    todo = [(s, rs) for s, rs in todo if rs]
    if not todo:
        return
    longest = max(s.length for s in samples)
    blocks = (len(rows) + 2) * (-(-longest // 32) + 2)
    engine = LLMEngine(EngineConfig(compile=options, num_kv_blocks=blocks, cache_eviction=OURS), log=lambda m: None)
    forked, tok = ForkedPrefill(engine), engine.tokenizer
    for i, (sample, rs) in enumerate(todo):
        start = time.perf_counter()
        outs = forked.generate(sample.prompt_ids, [r.setting for r in rs], sample.max_tokens,
                               done=lambda ids, s=sample: score(tok.decode(ids), s.answers) == 1.0)
        for r, ids in zip(rs, outs):
            cache.put(r.cache_name, sample, tok.decode(ids))
        log(f"  vinoserve {i + 1}/{len(todo)} {sample.task} {sample.length} {sample.placement}: "
            f"{len(rs)} rows in {time.perf_counter() - start:.1f} s")


def run_streamed(samples: list[Sample], rows: list[Row], cache: ResultCache, options: CompileOptions, log) -> None:
    """Rows that evict during prefill, as a server runs them: every (prompt, row) one request, all
    queued at once in one engine, the row's settings as the request's cache_eviction overrides."""
    from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
    from vinoserve.scheduler.sampling_params import SamplingParams

    todo = [(s, r) for r in rows for s in samples if s.key not in cache.get(r.cache_name)]
    if not todo:
        return
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(compile=options, cache_eviction=OURS), log=lambda m: None)
    for i, (s, r) in enumerate(todo):
        engine.add_request(str(i), list(s.prompt_ids), SamplingParams(max_tokens=s.max_tokens, temperature=0),
                           cache_eviction=asdict(r.setting))
    ids: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                s, r = todo[int(out.request_id)]
                cache.put(r.cache_name, s, engine.tokenizer.decode(ids[out.request_id]))
    log(f"  vinoserve, evicting during prefill: {len(todo)} requests in {time.perf_counter() - start:.0f} s")


def run_genai(samples: list[Sample], rows: list[Row], cache: ResultCache, tokenizer, eos: tuple[int, ...], log) -> None:
    from vinoserve.bench import longctx_genai
    from vinoserve.model import default_model

    gguf = str(default_model.fetch())
    for r in rows:
        todo = [s for s in samples if s.key not in cache.get(r.cache_name)]
        if not todo:
            continue
        start = time.perf_counter()
        spec = r.setting if r.budget is not None else "full"
        outs = longctx_genai.generate(gguf, [list(s.prompt_ids) for s in todo], [s.max_tokens for s in todo],
                                      spec, r.budget, eos)
        for s, ids in zip(todo, outs):
            cache.put(r.cache_name, s, tokenizer.decode(ids))
        log(f"  genai {r.name} {r.budget}: {len(todo)} prompts in {time.perf_counter() - start:.0f} s")


def task_scores(samples: list[Sample], replies: dict[str, str]) -> dict[str, float]:
    by_task: dict[str, list[float]] = {}
    for s in samples:
        if s.key in replies:
            by_task.setdefault(s.task, []).append(score(replies[s.key], s.answers))
    return {t: 100 * float(np.mean(v)) for t, v in by_task.items()}


def retained(row: dict[str, float], full: dict[str, float], tasks: list[str]) -> float | None:
    tasks = [t for t in tasks if t in row and t in full]
    if not tasks or sum(full[t] for t in tasks) == 0:
        return None
    return 100 * sum(row[t] for t in tasks) / sum(full[t] for t in tasks)


def build_rows(names: list[str], budgets: list[int], ours_overrides: str) -> list[Row]:
    rows = [Row("full", None, None)]
    if any(n.startswith("genai") for n in names):
        rows.append(Row("genai-full", None, "full"))
    for name in names:
        for b in budgets:
            if name in OUR_ROWS:
                rows.append(Row(name, b, our_setting(OUR_ROWS[name], b, ours_overrides if name.startswith("ours") else "")))
            elif name in GENAI_ROWS:
                rows.append(Row(name, b, GENAI_ROWS[name]))
            elif name.startswith("ours:"):  # an ad-hoc variant: ours:key=value,...
                rows.append(Row(name, b, our_setting(OURS, b, name[5:].replace(";", ","))))
            elif name.startswith("genai:"):
                rows.append(Row(name, b, name[6:].replace(";", ",")))
            else:
                raise ValueError(f"unknown row {name!r}: {', '.join([*OUR_ROWS, *GENAI_ROWS])}, ours:K=V;..., genai:K=V;...")
    return rows


def report(samples: list[Sample], rows: list[Row], cache: ResultCache, budgets: list[int], per_task: bool) -> str:
    lines = []
    groups = sorted({(s.length, s.placement) for s in samples}, key=lambda g: (g[0], PLACEMENTS.index(g[1])))
    for length, placement in groups:
        group = [s for s in samples if (s.length, s.placement) == (length, placement)]
        full = {r.engine: task_scores(group, cache.get(r.cache_name)) for r in rows if r.budget is None}
        ref = full["vinoserve"]
        counted = [t for t in TASKS if ref.get(t, 0) >= 50]
        singles = [t for t in counted if t in SINGLE_NEEDLE_TASKS]
        n = len(group) // max(1, len({s.task for s in group}))
        lines += [f"\n### {length} tokens, question {placement}: {n} prompts a task; counted "
                  f"(full cache >= 50%): {', '.join(counted) or 'none'}",
                  "", "retained % of the full cache's score, all counted tasks and the single-needle ones; "
                  "full-cache rows: their mean score", "",
                  "| row | " + " | ".join(f"{b}" for b in budgets) + " | " +
                  " | ".join(f"{b} single" for b in budgets) + " |", "|---" * (2 * len(budgets) + 1) + "|"]
        for engine, scores in full.items():
            cells = []
            for tasks in (counted, singles):
                have = [scores[t] for t in tasks if t in scores]
                cells += [f"{np.mean(have):.1f}" if have else "-"] * len(budgets)
            lines.append(f"| {engine} full cache | " + " | ".join(cells) + " |")
        for name in dict.fromkeys(r.name for r in rows if r.budget is not None):
            cells, single_cells = [], []
            for b in budgets:
                row = next((r for r in rows if r.name == name and r.budget == b), None)
                scores = task_scores(group, cache.get(row.cache_name)) if row else {}
                reference = full[row.engine] if row else {}
                for out, tasks in ((cells, counted), (single_cells, singles)):
                    value = retained(scores, reference, tasks)
                    out.append("-" if value is None else f"{value:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(single_cells) + " |")
        if per_task:
            lines += ["", "| row | budget | " + " | ".join(counted) + " |", "|---" * (len(counted) + 2) + "|"]
            for r in rows:
                scores = task_scores(group, cache.get(r.cache_name))
                lines.append(f"| {r.name} | {r.budget or 'full'} | " +
                             " | ".join(f"{scores.get(t, float('nan')):.0f}" for t in counted) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: passkey and niah_single_1 at 1K, one sample, budgets 256/512")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--lengths", default="4096", help="context lengths in tokens (prompt + answer)")
    p.add_argument("--placements", default="last", help="question last, first, or both: last,first")
    p.add_argument("--samples", type=int, default=5, help="prompts per task, length and placement")
    p.add_argument("--budgets", default="256,512,1024", help="max_cache_size of each evicting row")
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help="comma list of: " + ", ".join([*OUR_ROWS, *GENAI_ROWS]) +
                        "; ours:key=value;... and genai:key=value;... for variants")
    p.add_argument("--ours", default="", metavar="KEY=VALUE,...", help="override fields of ours' settings")
    p.add_argument("--haystack", choices=HAYSTACKS, default="essays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference-precision", default=None)
    p.add_argument("--kv-cache-precision", default=None)
    p.add_argument("--per-task", action="store_true", help="also print every row's score per task")
    p.add_argument("--report-only", action="store_true", help="print the table from cached replies, compute nothing")
    p.add_argument("--results", type=Path, default=None, help="reply cache folder (default: in the cache root)")


def main(args: argparse.Namespace) -> None:
    from vinoserve.model.loader import resolve_model_dir
    from vinoserve.model.tokenizer import Tokenizer

    if args.quick:
        args.tasks, args.lengths, args.samples, args.budgets = "passkey,niah_single_1", "1024", 1, "256,512"
        args.rows = "ours,streaming"
    log = print
    tasks, budgets = args.tasks.split(","), [int(b) for b in args.budgets.split(",")]
    lengths, placements = [int(x) for x in args.lengths.split(",")], args.placements.split(",")
    tokenizer = Tokenizer.from_ir_dir(resolve_model_dir(None, log=log))
    gen = Generator(tokenizer, haystack_text(args.haystack, log), args.seed)
    samples = [gen.sample(t, n, p, i) for n in lengths for p in placements for t in tasks for i in range(args.samples)]
    rows = build_rows(args.rows.split(","), budgets, args.ours)
    options = CompileOptions(inference_precision=args.inference_precision, kv_cache_precision=args.kv_cache_precision)
    precision = f"{args.inference_precision or 'default'}-{args.kv_cache_precision or 'default'}"
    cache = ResultCache(args.results or cache_root() / "bench" / "longctx", f"smollm2-{args.haystack}-{precision}")
    log(f"SmolLM2-135M-Instruct, {len(samples)} prompts ({args.samples} a task, length and placement), "
        f"{args.haystack} haystack, seed {args.seed}, precision {precision}, {os.cpu_count()} CPUs of "
        f"{cpu_name()}; replies cached in {cache.dir}")
    start = time.perf_counter()
    if args.report_only:
        print(report(samples, rows, cache, budgets, args.per_task))
        return
    run_ours(samples, [r for r in rows if r.engine == "vinoserve"], cache, options, log)
    genai_rows = [r for r in rows if r.engine == "genai"]
    if genai_rows:
        counted = _counted(samples, cache, rows)
        run_genai([s for s in samples if (s.length, s.placement, s.task) in counted], genai_rows, cache, tokenizer,
                  (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else (), log)
    log(f"computed in {time.perf_counter() - start:.0f} s")
    print(report(samples, rows, cache, budgets, args.per_task))


def cpu_name() -> str:
    import openvino as ov

    model = ""
    if Path("/proc/cpuinfo").is_file():
        model = next((line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model\t")), "")
    return ov.Core().get_property("CPU", "FULL_DEVICE_NAME") + (f" (model {model})" if model else "")


def _counted(samples: list[Sample], cache: ResultCache, rows: list[Row]) -> set[tuple[int, str, str]]:
    """(length, placement, task) where vinoserve's full cache scores >= 50%: genai runs only those."""
    full = cache.get(next(r for r in rows if r.budget is None and r.engine == "vinoserve").cache_name)
    groups = {(s.length, s.placement) for s in samples}
    out = set()
    for length, placement in groups:
        scores = task_scores([s for s in samples if (s.length, s.placement) == (length, placement)], full)
        out |= {(length, placement, t) for t, v in scores.items() if v >= 50}
    return out
