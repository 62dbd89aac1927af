"""Generate for one prompt: a paged model, a block table grown as the sequence grows."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vinoserve.cache.block_allocator import BlockAllocator
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.paged import PagedModel


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None
    chunk_size: int = 256  # prompt tokens per forward pass
    stop_token_ids: tuple[int, ...] = ()


def generate_tokens(model: PagedModel, prompt_ids: list[int], cfg: GenerationConfig) -> Iterator[int]:
    """Yields generated token ids; stops at a stop token (yielded) or after max_tokens."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    block = model.block_size
    total = len(prompt_ids) + cfg.max_tokens
    if total > model.config.max_context:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({cfg.max_tokens}) exceeds the "
                         f"model's context of {model.config.max_context} tokens")
    allocator = BlockAllocator(-(-total // block))
    runner = ModelRunner(model, KVCache(model.layout, model.config.num_layers, allocator.num_blocks))
    rng = np.random.default_rng(cfg.seed)
    table: list[int] = []

    def run(tokens: list[int], past: int, num_logits: int) -> np.ndarray:
        while len(table) * block < past + len(tokens):
            table.append(allocator.allocate())
        return runner.step([ScheduledChunk(tokens, past, table, num_logits)])[0]

    past = 0
    for start in range(0, len(prompt_ids), cfg.chunk_size):
        chunk = prompt_ids[start:start + cfg.chunk_size]
        logits = run(chunk, past, 1 if start + len(chunk) == len(prompt_ids) else 0)
        past += len(chunk)
    for _ in range(cfg.max_tokens):
        token = _sample(logits[-1], cfg.temperature, rng)
        yield token
        if token in cfg.stop_token_ids:
            return
        logits = run([token], past, 1)
        past += 1


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
