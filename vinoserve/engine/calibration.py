"""What a step costs on this machine, for this model, measured before the first request and
kept: speculation prices proposals by it (Speculator.budget). Priced from live timings, whether a
step verified proposals, and how many, moved with the machine's load, and with them a request's
greedy or seeded text at reduced precision, where a verifying step computes other logits than a
plain one (issue 59). With the figures fixed, the steps a request takes are a function of it.

A synthetic request (a short periodic prompt, greedy, ignore_eos) runs through the engine's own
step loop while the speculator follows a plan: plain steps alone and planned ahead, and steps
verifying 1, 2, 4, 8 and (where a step may take them) 16 proposals, in turn, a few rounds. The
least time of each size is its cost: what else ran on the machine only ever adds time. The figures
are kept in the cache directory, keyed by the model, its compilation, the CPU and OpenVINO, and a
later start prices by them unless it measured clearly faster steps: so every start on a machine
prices alike, and gives the same request the same steps.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import openvino as ov

from vinoserve.engine.config import StepStats
from vinoserve.engine.speculative import AHEAD
from vinoserve.model.cpu_class import this_cpu
from vinoserve.model.storage import cache_root
from vinoserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vinoserve.cache.block_manager import BlockManager
    from vinoserve.engine.model_runner import ModelRunner
    from vinoserve.engine.speculative import Speculator
    from vinoserve.model.loader import LoadedModel

REQUEST_ID = "vinoserve-calibration"
REPEATS = 4  # rounds of every size; the least of each is kept
VERSION = 2  # of what is measured and how: a change here measures anew
_PROMPT_TOKENS = 32
_PERIOD = 8  # the prompt repeats a run of this many tokens, so that prompt lookup finds proposals


class Engine(Protocol):
    """What calibration drives of LLMEngine (a protocol: the engine imports this module)."""
    speculator: Speculator
    model: LoadedModel
    blocks: BlockManager
    runner: ModelRunner
    stats: StepStats

    @property
    def max_context(self) -> int: ...
    @property
    def has_unfinished_requests(self) -> bool: ...
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Any: ...
    def step(self) -> Any: ...
    def abort_request(self, request_id: str) -> Any: ...


def plan(num_speculative_tokens: int, proposal_cap: int | None) -> list[int]:
    """Proposals for each step of the calibration (AHEAD: a plain step planned ahead, after a
    plain one), every size in turn, round after round: a burst of other work on the machine
    then slows one step of each size, not every step of one. It ends on a verifying step, after
    which no step is planned ahead."""
    most = max(num_speculative_tokens, 16) if proposal_cap is None else min(num_speculative_tokens, proposal_cap - 1)
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= most]
    return [0, AHEAD, *sizes] * REPEATS


def calibrate(engine: Engine, log=print) -> None:
    """Measures the step costs of `engine` before any request (its counters are left as if
    nothing had run), then prices by the figures kept for this machine and model: these, where
    they are the first or clearly faster (the kept ones were taken while something else ran),
    else the kept ones, so that every start prices alike. Without room for the measuring request
    (a tiny cache or context) nothing is measured and no step speculates."""
    spec = engine.speculator
    _measure(engine)
    spec.freeze()
    if (fit := spec.cost.fit()) is None:
        return
    path, measured = _figures_path(engine), spec.cost.figures()
    kept = _read(path)
    if kept is None or _clearly_faster(measured, kept):
        kept = _keep(path, measured)
        where = f"kept in {path}" if kept is not None else "not kept: the cache directory cannot be written"
        log(f"speculation: step costs measured ({fit[0] * 1e3:.1f} ms + {fit[1] * 1e3:.2f} ms a token), {where}")
    else:
        log(f"speculation: step costs as measured on this machine before ({path})")
    spec.cost.load(kept or measured)


def _clearly_faster(measured: dict, kept: dict) -> bool:
    """Steps a fifth faster in all than the kept figures say: those were taken under load."""
    sizes = measured["seconds"].keys() & {int(n) for n in kept["seconds"]}
    return sum(measured["seconds"][n] for n in sizes) < 0.8 * sum(kept["seconds"][str(n)] for n in sizes)


def _measure(engine: Engine) -> None:
    spec = engine.speculator
    steps = plan(spec.config.num_speculative_tokens, spec.proposal_cap)
    vocab = engine.model.config.vocab_size
    prompt = ([(17 + 7919 * i) % vocab for i in range(_PERIOD)] * _PROMPT_TOKENS)[:min(_PROMPT_TOKENS, engine.max_context // 4)]
    most = sum(max(k, 0) + 1 for k in steps)
    params = SamplingParams(max_tokens=max(1, min(most, engine.max_context - len(prompt))), temperature=0, ignore_eos=True)
    try:
        engine.add_request(REQUEST_ID, prompt, params)
    except ValueError:
        return
    spec.calibrate(steps)
    while spec.calibrating and engine.has_unfinished_requests:
        engine.step()
    engine.abort_request(REQUEST_ID)
    engine.step()  # finishes a step still planned ahead for it, if any
    engine.stats = StepStats()
    engine.runner.infer_seconds = 0.0
    if (prefix := engine.blocks.prefix) is not None:
        prefix.num_queried_tokens = prefix.num_hit_tokens = 0


def _figures_path(engine: Engine) -> Path:
    """Where this model's figures on this machine are kept: its files, its compilation, the
    proposer, the CPU (class, model, cores this process may use) and OpenVINO."""
    weights = engine.model.weight_files[0]
    stat = weights.stat() if weights.exists() else None
    key = json.dumps([VERSION, str(engine.model.path.resolve()), stat and [stat.st_size, stat.st_mtime_ns],
                      repr(engine.model.paged.options), repr(engine.speculator.config), engine.speculator.proposal_cap,
                      this_cpu().value, _cpu_model(), len(os.sched_getaffinity(0)), ov.get_version()])
    return cache_root() / "step-costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _read(path: Path) -> dict | None:
    try:
        figures = json.loads(path.read_text())
        return figures if {"seconds", "overlapped", "per_proposal"} <= figures.keys() else None
    except (OSError, ValueError, AttributeError):
        return None


def _keep(path: Path, figures: dict) -> dict | None:
    """Writes `figures` in place of any kept; returns what is kept then (another process may have
    written since), or None where the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({**figures, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        os.replace(f.name, path)
    except OSError:
        return None
    return _read(path)
