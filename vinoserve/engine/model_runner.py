"""One forward pass of the paged model over every token scheduled in a step, all sequences packed."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vinoserve.cache.kv_cache import KVCache
from vinoserve.model.paged import SAMPLED_INDICES, PagedModel


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence for this step, and where its KV lives."""

    token_ids: Sequence[int]
    past_len: int  # tokens of this sequence already in the cache
    block_table: Sequence[int]  # physical blocks covering past + new tokens
    num_logits: int = 1  # logits wanted for this many trailing tokens (0 mid-prompt)


class ModelRunner:
    def __init__(self, model: PagedModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.request = model.compiled.create_infer_request()
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            self.request.set_tensor(f"key_cache.{layer}", k)
            self.request.set_tensor(f"value_cache.{layer}", v)
        self._num_layers = model.config.num_layers
        self.infer_seconds = 0.0  # inside OpenVINO; the rest of a step is our Python

    def step(self, chunks: Sequence[ScheduledChunk]) -> list[np.ndarray]:
        """Runs the chunks; returns per chunk its logits [num_logits, vocab] (float32)."""
        lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
        past = np.array([c.past_len for c in chunks], dtype=np.int32)
        begins = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(lens, out=begins[1:])
        positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(past, lens)])
        tables = [np.asarray(c.block_table, dtype=np.int32) for c in chunks]
        table_begins = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum([len(t) for t in tables], out=table_begins[1:])
        blocks = np.concatenate(tables)
        sampled = np.concatenate([
            np.arange(begins[i + 1] - c.num_logits, begins[i + 1], dtype=np.int64)
            for i, c in enumerate(chunks)
        ])

        inputs = {
            "input_ids": np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks]),
            "position_ids": positions,
            "past_lens": past,
            "subsequence_begins": begins,
            "block_indices_begins": table_begins,
            "max_context_len": np.array(int((past + lens).max()), dtype=np.int32),
            SAMPLED_INDICES: sampled,
        }
        for layer in range(self._num_layers):
            inputs[f"block_indices.{layer}"] = blocks
        if len(sampled) == 0:
            # The graph needs at least one row to gather; compute one and drop it.
            inputs[SAMPLED_INDICES] = np.zeros(1, dtype=np.int64)
        start = time.perf_counter()
        self.request.infer(inputs, share_inputs=True)
        self.infer_seconds += time.perf_counter() - start
        logits = self.request.get_tensor("logits").data.reshape(-1, self.model.config.vocab_size)
        out, row = [], 0
        for c in chunks:
            out.append(np.array(logits[row:row + c.num_logits]))
            row += c.num_logits
        return out
