"""What a step costs, measured once before the first request: speculation prices proposals by it
(Speculator.budget), and the figures stand for the life of the process. So whether a step
verifies proposals, and how many, is a function of the request and the model alone; priced from
live timings it moved with the machine's load, and with it a request's greedy or seeded text at
reduced precision, where a verifying step computes other logits than a plain one (issue 59).

A synthetic request (a short periodic prompt, greedy, ignore_eos) runs through the engine's own
step loop while the speculator follows a plan: plain steps alone and planned ahead, then steps
verifying 1, 2, 4, 8 and (where a step may take them) 16 proposals, each a few times. The least
time of each size is its cost: what else ran on the machine only ever adds time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vinoserve.engine.config import StepStats
from vinoserve.engine.speculative import AHEAD
from vinoserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vinoserve.engine.llm_engine import LLMEngine

REQUEST_ID = "vinoserve-calibration"
REPEATS = 3  # of each size; the least is kept
_PROMPT_TOKENS = 32
_PERIOD = 8  # the prompt repeats a run of this many tokens, so that prompt lookup finds proposals


def plan(num_speculative_tokens: int, proposal_cap: int | None) -> list[int]:
    """Proposals for each step of the calibration (AHEAD: a plain step planned ahead). It ends on
    a verifying step, after which no step is planned ahead."""
    most = max(num_speculative_tokens, 16) if proposal_cap is None else min(num_speculative_tokens, proposal_cap - 1)
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= most]
    return [k for k in [0, AHEAD, *sizes] for _ in range(REPEATS)]


def calibrate(engine: LLMEngine) -> None:
    """Measures the step costs on `engine`, before any request, and freezes them; leaves its
    counters as if nothing had run. Without room for the request (a tiny cache or context) no
    cost is measured and no step speculates."""
    spec = engine.speculator
    steps = plan(spec.config.num_speculative_tokens, spec.proposal_cap)
    vocab = engine.model.config.vocab_size
    prompt = ([(17 + 7919 * i) % vocab for i in range(_PERIOD)] * _PROMPT_TOKENS)[:min(_PROMPT_TOKENS, engine.max_context // 4)]
    most = sum(max(k, 0) + 1 for k in steps)
    params = SamplingParams(max_tokens=max(1, min(most, engine.max_context - len(prompt))), temperature=0, ignore_eos=True)
    try:
        engine.add_request(REQUEST_ID, prompt, params)
    except ValueError:
        spec.freeze()
        return
    spec.calibrate(steps)
    while spec.calibrating and engine.has_unfinished_requests:
        engine.step()
    engine.abort_request(REQUEST_ID)
    engine.step()  # finishes a step still planned ahead for it, if any
    spec.freeze()
    engine.stats = StepStats()
    engine.runner.infer_seconds = 0.0
    if (prefix := engine.blocks.prefix) is not None:
        prefix.num_queried_tokens = prefix.num_hit_tokens = 0
