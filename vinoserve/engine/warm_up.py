"""One prompt chunk and one decode step before the first request.

The CPU plugin packs each matmul's weights for its kernels on the first inference that uses
them, from the IR's constants (mapped from openvino_model.bin). Doing it here keeps that time out
of the first request's latency; the engine then lets the mapped pages it read go
(mapped_pages.py), so the weights are resident once. The step writes into cache blocks no sequence holds yet.
"""
from __future__ import annotations

from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk

_PROMPT_BLOCKS = 2  # a prompt chunk of two blocks (64 tokens on CPU): the kernels of a long prefill


def warm_up(runner: ModelRunner, num_blocks: int, block_size: int) -> None:
    blocks = list(range(min(num_blocks, _PROMPT_BLOCKS + 1)))
    prompt = min(len(blocks) - 1, _PROMPT_BLOCKS) * block_size or 1
    runner.step([ScheduledChunk([0] * prompt, 0, [blocks])])
    runner.step([ScheduledChunk([0], prompt, [blocks], prompt=False)])
