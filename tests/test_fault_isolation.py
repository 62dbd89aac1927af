"""Fault isolation: a fault in one request's handling fails that request (500, OpenAI error body)
and every other request runs to the reference result with its blocks freed; a fault that breaks
the engine makes /health say 503 with the reason and the process exit non-zero. Faults are
injected by patching real engine code, not by mocking the engine."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_process import free_port
from test_engine import F32, GREEDY, reference, tiny  # noqa: F401  (fixtures)
from vinoserve.engine import text_output
from vinoserve.engine.async_engine import AsyncLLMEngine, EngineDead, RequestFailed
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.scheduler import sampler as sampler_module
from vinoserve.scheduler.sampling_params import SamplingParams

HERE = Path(__file__).parent


@pytest.fixture
def engine(tiny):  # noqa: F811
    _, path, _ = tiny
    died: list[BaseException] = []
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=path, compile=F32, num_kv_blocks=64), log=lambda m: None),
                         on_fatal=died.append)
    eng.died = died
    yield eng
    eng.shutdown()


async def _run(engine: AsyncLLMEngine, ids: list[int], params: SamplingParams) -> list[int] | BaseException:
    tokens: list[int] = []
    try:
        async for out in engine.generate(ids, params):
            tokens += out.new_token_ids
    except (RequestFailed, EngineDead) as e:
        return e
    return tokens


def _all_free(engine: AsyncLLMEngine) -> bool:
    deadline = time.monotonic() + 10
    while engine.engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


@pytest.mark.parametrize("where", ["detokenisation", "sampling"])
def test_a_fault_in_one_request_fails_only_that_request(engine, tiny, reference, monkeypatch, where):  # noqa: F811
    _, _, prompts = tiny
    faulty = SamplingParams(max_tokens=24, temperature=0, stop=("BOOM",), seed=99)
    if where == "detokenisation":
        add = text_output.TextOutput.add

        def broken_add(self, token_id):
            if "BOOM" in self._stop:
                raise UnicodeError("injected")
            return add(self, token_id)

        monkeypatch.setattr(text_output.TextOutput, "add", broken_add)
    else:
        sample = sampler_module.Sampler.sample

        def broken_sample(self, logits, rows):
            if any(r.params.seed == 99 for r in rows):
                raise FloatingPointError("injected")
            return sample(self, logits, rows)

        monkeypatch.setattr(sampler_module.Sampler, "sample", broken_sample)

    async def main():
        return await asyncio.gather(*(_run(engine, p, GREEDY) for p in prompts), _run(engine, prompts[1], faulty))

    *results, failed = asyncio.run(main())
    assert isinstance(failed, RequestFailed) and "injected" in str(failed)
    assert results == reference  # every other request exactly as without the fault
    assert engine.is_alive and not engine.died
    assert _all_free(engine)
    assert asyncio.run(_run(engine, prompts[0], GREEDY)) == reference[0]  # and it keeps serving


def test_a_fault_that_breaks_the_engine_fails_everyone_and_reports(engine, tiny, monkeypatch):  # noqa: F811
    _, _, prompts = tiny
    runner = engine.engine.runner
    wait = type(runner).wait
    calls = {"n": 0}

    def broken_wait(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return wait(self, *args, **kwargs)

    monkeypatch.setattr(type(runner), "wait", broken_wait)

    async def main():
        return await asyncio.gather(*(_run(engine, p, GREEDY) for p in prompts))

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDead) for r in results)
    assert not engine.is_alive and len(engine.died) == 1 and "injected" in str(engine.error)
    with pytest.raises(EngineDead):
        engine.submit(prompts[0], GREEDY)


@pytest.fixture(scope="module")
def fault_server(tiny):  # noqa: F811
    _, path, _ = tiny
    port = free_port()
    log = open(os.devnull, "w")
    proc = subprocess.Popen([sys.executable, str(HERE / "fault_server.py"), "--model", path, "--port", str(port),
                             "--kv-cache-size", "0.05"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")]))})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def test_server_fault_isolation_then_engine_death_exits_non_zero(fault_server):
    proc, url = fault_server

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            good = [client.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 20, "ignore_eos": True,
                                                                "stream": i % 2 == 1}) for i in range(6)]
            bad = client.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 20, "stop": ["BOOM"]})
            bad_stream = client.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stop": "BOOM", "stream": True})
            return await asyncio.gather(*good, bad, bad_stream)

    *good, bad, bad_stream = asyncio.run(burst())
    assert [r.status_code for r in good] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in good[0::2])
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in good[1::2])
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
    assert "injected" in bad.json()["error"]["message"] and "Traceback" not in bad.text
    assert '"code": "request_failed"' in bad_stream.text  # headers were sent: the error is an event
    assert httpx.get(f"{url}/health").status_code == 200

    dead = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 5, "seed": 13}, timeout=60)
    assert dead.status_code == 500 and dead.json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "injected engine fault" in health.json()["error"]["message"]
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    assert proc.wait(30) == 1


@pytest.mark.slow
def test_a_batch_sampled_again_after_a_fault_advances_grammars_once(smollm2_gguf, monkeypatch):
    """The engine, not the sampler, advances a request's grammar: when a batch fails after its
    tokens were drawn and each request is sampled alone, a constrained neighbour still sees
    each token once and keeps to its grammar."""
    from vinoserve.scheduler.grammar import GrammarSpec

    prompts = ["Pick a number: ", "Once upon a time"]
    constrained = SamplingParams(max_tokens=12, temperature=0, grammar=GrammarSpec("regex", "[0-9]{6}"))
    faulty = SamplingParams(max_tokens=12, temperature=0, seed=99, logprobs=1)

    def run(requests):
        engine = LLMEngine(EngineConfig(compile=F32, weight_format="f32", num_kv_blocks=16), log=lambda m: None)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
        texts = {f"r{i}": "" for i in range(len(requests))}
        while engine.has_unfinished_requests:
            for o in engine.step():
                texts[o.request_id] += o.new_text
        return texts["r0"]

    alone = run([(prompts[0], constrained)])
    assert len(alone) == 6 and alone.isdigit()
    with_logprobs = sampler_module._with_logprobs

    def broken(logits, tokens, rows):
        if any(r.params.seed == 99 for r in rows):
            raise FloatingPointError("injected after the draw")
        return with_logprobs(logits, tokens, rows)

    monkeypatch.setattr(sampler_module, "_with_logprobs", broken)
    assert run([(prompts[0], constrained), (prompts[1], faulty)]) == alone
