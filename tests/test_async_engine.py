"""The async engine: concurrent streams equal the offline results; a consumer that walks away
aborts its request at a step boundary and its blocks come back."""
from __future__ import annotations

import asyncio
import time

import pytest

from test_engine import F32, GREEDY, tiny, reference  # noqa: F401  (fixtures)
from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny):  # noqa: F811
    _, path, _ = tiny
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=path, compile=F32, num_kv_blocks=64), log=lambda m: None))
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncLLMEngine, ids: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(ids, GREEDY):
        tokens += out.new_token_ids
    return tokens


def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.01)


def test_concurrent_streams_match_reference(engine, tiny, reference):  # noqa: F811
    _, _, prompts = tiny

    async def main():
        return await asyncio.gather(*(_collect(engine, p) for p in prompts))

    assert asyncio.run(main()) == reference
    _wait_idle(engine)
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_walking_away_aborts_and_frees_blocks(engine, tiny, reference):  # noqa: F811
    _, _, prompts = tiny

    async def main():
        partial = []
        gen = engine.generate(prompts[3], GREEDY)
        async for out in gen:
            partial += out.new_token_ids
            if len(partial) >= 3:
                break
        await gen.aclose()
        full = await _collect(engine, prompts[0])
        return partial, full

    partial, full = asyncio.run(main())
    assert partial == reference[3][:3] and full == reference[0]
    _wait_idle(engine)
    assert engine.engine.num_requests == 0
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_bad_request_fails_in_the_caller(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.prepare([1] * 600, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.prepare([1], SamplingParams(max_tokens=-1))
    assert engine.is_alive
