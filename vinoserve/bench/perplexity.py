"""Teacher-forced perplexity of the engine on real English text.

The engine prefills the first part of a window, then the true next tokens are fed one decode step
at a time, exactly as in generation (cache eviction, when configured, is active), and the
log-probability the model gave each true token is recorded. Used by the eviction and precision
benchmarks and by the long-context precision test.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vinoserve.bench.workloads import stdlib_english
from vinoserve.cache.eviction import CacheEvictionConfig
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampler import SamplerOutput
from vinoserve.scheduler.sampling_params import SamplingParams


def english_text() -> str:
    """The GPL's text (Debian's common-licenses) and the standard library's documentation."""
    gpl = Path("/usr/share/common-licenses/GPL-3")
    return (gpl.read_text() + "\n\n" if gpl.is_file() else "") + stdlib_english()


def text_windows(count: int, length: int) -> tuple[list[list[int]], int]:
    """`count` evenly spread windows of `length` tokens of the text, and how many tokens it has."""
    tok = LLMEngine(EngineConfig(num_kv_blocks=1), log=lambda m: None).tokenizer
    ids = tok.encode(english_text(), add_special_tokens=False)
    stride = (len(ids) - length) // max(1, count - 1)
    return [ids[i * stride:i * stride + length] for i in range(count)], len(ids)


class TeacherForcing:
    """Stands in for the sampler: emits the true next token and records the log-probability
    the model gave it."""

    def __init__(self, targets: dict[int, list[int]]) -> None:
        self.targets = targets  # keyed by id() of the request's prompt list
        self.logprobs: dict[int, list[float]] = {k: [] for k in targets}

    def sample(self, logits: np.ndarray, rows) -> SamplerOutput:
        tokens = []
        for row, state in zip(logits.astype(np.float64), rows):
            key = id(state.prompt_token_ids)
            true = self.targets[key][len(state.output_token_ids)]
            z = row - row.max()
            self.logprobs[key].append(float(z[true] - np.log(np.exp(z).sum())))
            tokens.append(true)
        n = len(tokens)
        return SamplerOutput(np.array(tokens, dtype=np.int64), np.full(n, np.nan, np.float32), [None] * n)


@dataclass
class Result:
    perplexity: float
    peak_blocks: int  # most KV blocks one sequence held per layer while decoding


def perplexity(windows: Sequence[Sequence[int]], prefill: int, options: CompileOptions,
               eviction: CacheEvictionConfig | None = None, model: str | None = None,
               weight_format: str = "auto") -> Result:
    """Perplexity over tokens prefill.. of every window, all windows decoded in one batch."""
    blocks_per_window = -(-len(windows[0]) // 32) + 16  # the CPU kernel's 32-token blocks, plus slack
    engine = LLMEngine(EngineConfig(model=model, compile=options, cache_eviction=eviction, weight_format=weight_format,
                                    speculative=None,  # the model's own one-token steps
                                    num_kv_blocks=len(windows) * blocks_per_window), log=lambda m: None)
    prompts = [list(w[:prefill]) for w in windows]
    teacher = TeacherForcing({id(p): list(w[prefill:]) for p, w in zip(prompts, windows)})
    engine.sampler = teacher
    steps = len(windows[0]) - prefill
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, SamplingParams(max_tokens=steps, ignore_eos=True))
    # add_request copies the prompt into the sequence: re-key the teacher by the engine's lists.
    teacher.targets = {id(r.seq.prompt_token_ids): teacher.targets[id(p)]
                       for r, p in zip(engine._requests.values(), prompts)}
    teacher.logprobs = {k: [] for k in teacher.targets}
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        # Prefill holds the whole prompt (no eviction there); what eviction bounds is decode.
        peak = max([peak] + [len(r.seq.block_tables[0]) for r in engine._requests.values()
                             if r.seq.num_computed_tokens > len(r.seq.prompt_token_ids)])
    nll = -np.mean([lp for lps in teacher.logprobs.values() for lp in lps])
    return Result(math.exp(nll), peak)
