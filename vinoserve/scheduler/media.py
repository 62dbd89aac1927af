"""Images in a prompt: rows of embeddings (a vision tower's output) that the language model takes
in place of the token embeddings at given prompt positions.

The tokens at those positions stay whatever the caller put there (a family's image token): the
scheduler, speculation, grammars and stop strings act on tokens and need not know. What does
need to know: the runner, which feeds each step the rows its chunks cover (again after a
preemption), and prefix caching, whose blocks holding image rows are keyed by the image too.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vinoserve.model.image_inputs import ImageRules


@dataclass(frozen=True, eq=False)
class ImageSpan:
    offset: int  # prompt position of its first row
    embeddings: np.ndarray  # float32 [n, hidden]: rows for prompt positions offset .. offset+n-1
    key: bytes  # what the image is (hash of its pixels + the vision model), for prefix caching
    # its rows attend to each other both ways (model/image_attention.py): computed in one chunk
    bidirectional: bool = False
    # M-RoPE models (Qwen2-VL): the image's rows as a (height, width) grid; its rows take their
    # place in it as positions (rope_positions). None: positions as text's.
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + len(self.embeddings)


Spans = Sequence[ImageSpan]  # a prompt's images, as callers give them


def checked_spans(spans: Spans, prompt_len: int, rules: ImageRules) -> tuple[ImageSpan, ...]:
    """The spans in prompt order, float32; ValueError naming the problem where a span is outside
    the prompt, overlaps another, has rows of another width than the model's hidden size or
    breaks another of the model's `rules` (rows attending both ways: images of a bounded size;
    rows placed by M-RoPE: each image's grid, and only then)."""
    if not spans:
        return ()
    width, bidirectional_rows = rules.width, rules.bidirectional_rows
    if width is None:
        raise ValueError("this model takes no images")
    out, end = [], 0
    for span in sorted(spans, key=lambda s: s.offset):
        rows, at = np.asarray(span.embeddings), f"the image at position {span.offset}"
        if rows.ndim != 2 or rows.shape[1] != width or not len(rows):
            raise ValueError(f"{at}: embeddings of shape {list(rows.shape)}; this model takes [rows >= 1, {width}]")
        if not isinstance(span.key, bytes) or not span.key:
            raise ValueError(f"{at}: its key must be non-empty bytes")
        if span.offset < end:
            raise ValueError(f"{at} overlaps the one before it (ending at {end})" if out else f"{at} is outside the prompt")
        end = span.offset + len(rows)
        if end > prompt_len:
            raise ValueError(f"{at}: rows {span.offset}..{end - 1} run past the prompt's {prompt_len} tokens")
        if not np.isfinite(rows).all():
            raise ValueError(f"{at}: its embeddings are not all finite")
        if bidirectional_rows is not None and len(rows) > bidirectional_rows:
            raise ValueError(f"{at}: {len(rows)} rows; this model's attention inside an image is exact "
                             f"for images of at most {bidirectional_rows} rows (its sliding window)")
        _check_grid(span.grid, len(rows), rules.grids, at)
        out.append(ImageSpan(span.offset, np.ascontiguousarray(rows, np.float32), span.key,
                             bidirectional_rows is not None, span.grid))
    return tuple(out)


def _check_grid(grid: tuple[int, int] | None, rows: int, grids: bool, at: str) -> None:
    if not grids:
        if grid is not None:
            raise ValueError(f"{at}: a grid {list(grid)}, but this model places image rows as text (no M-RoPE)")
        return
    if grid is None or len(grid) != 2 or min(grid) < 1 or grid[0] * grid[1] != rows:
        raise ValueError(f"{at}: this model places image rows by M-RoPE and needs each image's grid "
                         f"(height, width) of its {rows} rows; got {grid}")


def rope_shift(spans: Sequence[ImageSpan], position: int) -> int:
    """How far M-RoPE positions of text at `position` are from its index: each image with a grid
    that ends at or before it took max(height, width) positions for its height x width rows
    (HF's get_rope_index). 0 without such images."""
    return sum(max(s.grid) - len(s.embeddings) for s in spans if s.grid is not None and s.end <= position)


def rope_positions(spans: Sequence[ImageSpan], start: int, stop: int) -> np.ndarray | None:
    """int64 [3, stop - start]: the temporal, height and width positions of [start, stop) where
    rows of an image with a grid lie there (its rows at the position it starts at, plus their row
    and column); None where none do: there every position is index + rope_shift(start)."""
    if not any(s.grid is not None and s.offset < stop and s.end > start for s in spans):
        return None
    index = np.arange(start, stop, dtype=np.int64)
    out = np.repeat(index[None], 3, axis=0)
    for span in spans:
        if span.grid is None:
            continue
        out[:, index >= span.end] += max(span.grid) - len(span.embeddings)
        k = index - span.offset
        inside = (k >= 0) & (k < len(span.embeddings))
        if inside.any():
            first = span.offset + rope_shift(spans, span.offset)
            out[0, inside] = first
            out[1, inside] = first + k[inside] // span.grid[1]
            out[2, inside] = first + k[inside] % span.grid[1]
    return out


def rows_in(spans: Sequence[ImageSpan], start: int, stop: int) -> list[tuple[int, np.ndarray]]:
    """(position, rows) of the image rows at prompt positions [start, stop), in order: a chunk of a
    prefill takes exactly these (the rest of a span is in the chunks before and after it)."""
    out = []
    for span in spans:
        lo, hi = max(start, span.offset), min(stop, span.end)
        if lo < hi:
            out.append((lo, span.embeddings[lo - span.offset:hi - span.offset]))
    return out


def whole_images_end(spans: Sequence[ImageSpan], start: int, end: int) -> int:
    """Where a chunk from `start` that would end at `end` ends so that it cuts no image whose rows
    attend to each other both ways: before the image it would cut, or, where that image starts
    the chunk, after it (over the budget: those rows have to be computed together)."""
    for span in spans:
        if span.bidirectional and span.offset < end < span.end:
            return span.offset if span.offset > start else span.end
    return end


def inside_whole_image(spans: Sequence[ImageSpan], position: int) -> bool:
    """Whether KV computed up to `position` would end inside such an image (a prefix-cache hit
    cannot end there: its rows before would not have seen the ones after)."""
    return any(span.bidirectional and span.offset < position < span.end for span in spans)


def extra_keys(spans: Sequence[ImageSpan], start: int, stop: int) -> bytes:
    """What besides the tokens fixes the KV of positions [start, stop) (a prefix-cache block): each
    image with rows there, and where it starts relative to `start` (vLLM's
    _gen_mm_extra_hash_keys: its hash and offset). b"" where no image has rows there."""
    keys = b""
    for span in spans:
        if span.offset < stop and span.end > start:
            keys += np.int64(len(span.key)).tobytes() + span.key + np.int64(span.offset - start).tobytes()
    return keys


def same_images(a: Spans, b: Spans) -> bool:
    """Whether two prompts' images give the same KV (a fork shares its parent's)."""
    return [(x.offset, x.key, x.grid) for x in a] == [(x.offset, x.key, x.grid) for x in b]
