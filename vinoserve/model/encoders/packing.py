"""A ragged batch of token sequences -> the encoder graph's inputs (graph.py's INPUTS).

Token-wise layers always see the tokens packed with no padding. For attention the host picks:
"padded" lines sequences up in [B, L] (each attends within its row; pads are masked keys), and
"block" makes the whole batch one [1, T] row under a block-diagonal mask. Padded wastes
attention work on pads, block on the off-diagonal blocks; benchmarks/encoder_layouts.py measures
both, and `choose_layout` keeps the cheaper by that count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from vinoserve.model.encoders.config import EncoderConfig

Layout = Literal["padded", "block", "auto"]
_NEG = np.float32(-np.inf)


@dataclass(frozen=True)
class Sequence:
    ids: list[int]
    type_ids: list[int] | None = None


def choose_layout(lengths: list[int]) -> Literal["padded", "block"]:
    """Attention cost is about the number of (query, key) pairs computed: B * L^2 padded,
    T^2 as one block. Block only wins when one long sequence pads many short ones."""
    total, longest = sum(lengths), max(lengths)
    return "block" if total * total < len(lengths) * longest * longest else "padded"


def pack(seqs: list[Sequence], cfg: EncoderConfig, layout: Layout = "auto") -> dict[str, np.ndarray]:
    lengths = [len(s.ids) for s in seqs]
    if layout == "auto":
        layout = choose_layout(lengths)
    total, batch = sum(lengths), len(seqs)
    starts = np.cumsum([0] + lengths[:-1])
    ids = np.fromiter((t for s in seqs for t in s.ids), np.int64, total)
    types = np.zeros(total, np.int64)
    for s, start in zip(seqs, starts):
        if s.type_ids is not None:
            types[start:start + len(s.ids)] = s.type_ids
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]) + cfg.position_offset
    if layout == "block":
        gather = np.arange(total, dtype=np.int64)[None, :]
        scatter = np.arange(total, dtype=np.int64)
        owner = np.repeat(np.arange(batch), lengths)
        mask = np.where(owner[:, None] == owner[None, :], np.float32(0), _NEG)[None, None]
    else:
        longest = max(lengths)
        offsets = np.arange(longest, dtype=np.int64)[None, :]
        valid = offsets < np.asarray(lengths)[:, None]
        gather = np.where(valid, starts[:, None] + offsets, 0)
        scatter = (np.arange(batch, dtype=np.int64)[:, None] * longest + offsets)[valid]
        mask = np.where(valid, np.float32(0), _NEG)[:, None, None, :]
    return {"input_ids": ids, "token_type_ids": types, "position_ids": positions, "gather_index": gather,
            "attention_mask": mask.astype(np.float32), "scatter_index": scatter,
            "pool": _pool_weights(lengths, starts, total, "cls" if cfg.is_classifier else cfg.pooling)}


def right_padded(seqs: list[Sequence]) -> dict[str, np.ndarray]:
    """[B, L] inputs of a graph exported with padding (optimum's, a converted decoder's):
    input_ids, token_type_ids, attention_mask, position_ids, and each row's `lengths`."""
    lengths = np.array([len(s.ids) for s in seqs])
    batch, longest = len(seqs), int(lengths.max())
    ids, types, mask = (np.zeros((batch, longest), np.int64) for _ in range(3))
    for row, s in enumerate(seqs):
        ids[row, :len(s.ids)] = s.ids
        types[row, :len(s.ids)] = s.type_ids or 0
        mask[row, :len(s.ids)] = 1
    positions = np.broadcast_to(np.arange(longest, dtype=np.int64), (batch, longest)).copy()
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "position_ids": positions,
            "lengths": lengths}


def _pool_weights(lengths: list[int], starts: np.ndarray, total: int, pooling: str) -> np.ndarray:
    pool = np.zeros((len(lengths), total), np.float32)
    for row, (n, start) in enumerate(zip(lengths, starts)):
        if pooling == "cls":
            pool[row, start] = 1.0
        elif pooling == "last":
            pool[row, start + n - 1] = 1.0
        else:  # mean, or sentence-transformers' mean_sqrt_len (the sum over sqrt(n))
            pool[row, start:start + n] = 1.0 / (n if pooling == "mean" else np.sqrt(n))
    return pool
