"""Offline batch API: LLM(model).generate(prompts, SamplingParams)."""
from __future__ import annotations

from collections.abc import Sequence

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.outputs import CompletionOutput
from vinoserve.scheduler import media
from vinoserve.scheduler.sampling_params import SamplingParams


class LLM:
    def __init__(self, config: EngineConfig = EngineConfig(), log=print) -> None:
        self.engine = LLMEngine(config, log)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 images: Sequence[media.Spans] | None = None) -> list[CompletionOutput]:
        """All prompts batched together; results in prompt order, `n` consecutive choices per
        prompt: the first computes the prompt, the others share its KV and sample on their own
        (with a seed, choice j uses seed + j, as the server does). `images`: per prompt, its
        image rows (an engine with EngineConfig.image_inputs)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        images = [()] * len(prompts) if images is None else list(images)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but images for {len(images)}")
        results: dict[str, CompletionOutput] = {}
        for i, (prompt, p, spans) in enumerate(zip(prompts, per_prompt, images)):
            prompt = prompt if isinstance(prompt, str) else list(prompt)
            for j in range(p.n):
                rid = f"offline-{i}-{j}"
                ids = self.engine.add_request(rid, prompt, p.choice(j), fork_of=f"offline-{i}-0" if j else None,
                                              images=spans)
                results[rid] = CompletionOutput(rid, ids)
        while self.engine.has_unfinished_requests:
            for out in self.engine.step():
                results[out.request_id].add(out)
        return list(results.values())
