"""One forward pass of the paged model over every token scheduled in a step, all sequences packed."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from vinoserve.cache.kv_cache import KVCache
from vinoserve.model import lowbit
from vinoserve.model.blocks import ROPE_OFFSETS
from vinoserve.model.image_attention import TOKEN_TYPES
from vinoserve.model.image_inputs import IMAGE_EMBEDS, IMAGE_ROWS
from vinoserve.model.paged import SAMPLED_INDICES, PagedModel


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence for this step, and where its KV lives."""

    token_ids: Sequence[int]
    past_len: int  # tokens of this sequence in the cache (after any eviction)
    block_tables: Sequence[Sequence[int]]  # physical blocks for past + new: one table, or one per layer
    num_logits: int = 1  # logits wanted for this many trailing tokens (0 mid-prompt)
    first_position: int | None = None  # RoPE position of the first new token; default past_len
    score_window: int = 0  # queries whose attention scores are summed (cache eviction)
    # Tokens read in (a prompt, or a preempted sequence's recomputed tokens) rather than the one
    # just generated and its proposals: where the model has lowbit.PLANES, a step with any such
    # chunk quantizes activations in two int8 planes (see ModelRunner.planes).
    prompt: bool = True
    # (row within the chunk, float32 [n, hidden]) of image rows that take the place of the token
    # embeddings there (scheduler/media.py); only where the model takes images
    images: Sequence[tuple[int, np.ndarray]] = ()
    # M-RoPE (scheduler/media.py): int64 [3, len(token_ids)] temporal/height/width positions where
    # image rows lie in the chunk; None: positions first_position onwards, the three alike
    rope_positions: np.ndarray | None = None


@dataclass(frozen=True)
class StepResult:
    # [sum of num_logits, vocab] float32: every chunk's logits, in chunk order. A view of the
    # request's output tensor, valid until that request runs again (two steps on): copy what must last.
    rows: np.ndarray
    num_logits: list[int]  # rows per chunk
    scores: list[np.ndarray] | None  # per layer, flat over chunks of (past + new); None without eviction

    @property
    def logits(self) -> list[np.ndarray]:
        """Per chunk [num_logits, vocab]: views into `rows` (built on demand: most steps need only rows)."""
        ends = itertools.accumulate(self.num_logits)
        return [self.rows[end - n:end] for n, end in zip(self.num_logits, ends)]


@dataclass(frozen=True)
class KernelRotation:
    """Per-layer inputs of the kernel's in-place key rotation for this step."""

    table: np.ndarray  # [rows, head_size]
    blocks: list[np.ndarray]  # per layer [R] int32
    deltas: list[np.ndarray]  # per layer [R, 1] int32


@dataclass
class PreparedStep:
    """A step's inputs, set on an idle infer request; started by ModelRunner.start."""

    request: ov.InferRequest
    inputs: dict[str, np.ndarray]  # what the request reads: views of its buffers until it is prepared again
    placeholders: list[int]  # rows of input_ids whose token the previous step is still sampling
    num_logits: list[int]


class _InputTensors:
    """One request's inputs: a tensor per input over a buffer of ours, set on the request once and
    reshaped in place each step. Setting new tensors every step cost 0.4 ms of a 16-sequence step on
    Zen 4 (run while the other request computes, on the cores it computes on)."""

    def __init__(self, request: ov.InferRequest) -> None:
        self.request = request
        self.takes_images = any(IMAGE_EMBEDS in i.get_names() for i in request.model_inputs)
        self.takes_token_types = any(TOKEN_TYPES in i.get_names() for i in request.model_inputs)
        self._buffers: dict[str, np.ndarray] = {}
        self._tensors: dict[str, ov.Tensor] = {}

    def write(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copies each array into its input's tensor; returns the views the request reads."""
        views = {}
        for name, array in inputs.items():
            buffer = self._buffers.get(name)
            if buffer is None or buffer.size < array.size:  # grown by doubling, so rarely
                buffer = np.empty(max(array.size, 2 * (0 if buffer is None else buffer.size), 1), array.dtype)
                tensor = ov.Tensor(buffer, shared_memory=True)  # the buffer's owner is this object
                tensor.shape = list(array.shape)
                self.request.set_tensor(name, tensor)
                self._buffers[name], self._tensors[name] = buffer, tensor
            else:
                self._tensors[name].shape = list(array.shape)
            views[name] = buffer[:array.size].reshape(array.shape)
            views[name][...] = array
        return views


class ModelRunner:
    """Runs steps on infer requests in turn: with two, the next step's inputs can be set on one
    while the other computes (see LLMEngine's overlapped step loop)."""

    def __init__(self, model: PagedModel, cache: KVCache, num_requests: int = 2,
                 table_of: Sequence[int] | None = None) -> None:
        """`table_of`: per layer, which of a chunk's block tables it reads when a chunk has
        several (default: one table per layer, as eviction keeps them)."""
        self.model = model
        self.cache = cache
        # Per turn, a request of the main model and one of the second compilation (the decode model,
        # model/decode_model.py, or the kernel's one-token clone, model/one_token.py), both over the
        # same cache: a step goes to one of them by its token count.
        self._inputs = [self._bind(model.compiled, cache) for _ in range(num_requests)]
        self._decode_inputs = [self._bind(model.decode, cache) for _ in range(num_requests)] if model.decode else None
        # Steps of at most this many tokens run on the second compilation (None: there is none).
        self.fast_step_tokens = model.decode_tokens
        self._turn = 0
        self._num_layers = model.facts.num_layers
        self._has_scores = model.options.score_outputs
        self._has_rotation = model.options.cache_rotation
        self._per_layer_tables = model.options.per_layer_block_tables
        self._has_planes = lowbit.PLANES in model.input_names
        self._image_width = model.image_width
        self._has_rope_offsets = ROPE_OFFSETS in model.input_names
        self._position_streams = model.position_streams
        # a step without image rows gives the image inputs these, made once (inputs are copied in)
        self._no_images = (None if self._image_width is None else
                           (np.zeros(0, np.int64), np.zeros((0, self._image_width), np.float32)))
        self._table_of = list(range(self._num_layers)) if table_of is None else list(table_of)
        self._num_tables = max(self._table_of) + 1
        self.infer_seconds = 0.0  # blocked on OpenVINO (starting, waiting); the rest of a step is our Python

    def step(self, chunks: Sequence[ScheduledChunk], rotation: KernelRotation | None = None) -> StepResult:
        """One step, start to finish."""
        prepared = self.prepare(chunks, rotation)
        self.start(prepared)
        return self.wait(prepared)

    def prepare(self, chunks: Sequence[ScheduledChunk], rotation: KernelRotation | None = None) -> PreparedStep:
        """Sets a step's inputs on the idle request. A token id of -1 is a placeholder that
        start() fills in. Call while the other request may still be computing."""
        # Built with one numpy call per input, not one per chunk: at 64 sequences the per-chunk
        # aranges and concatenations were most of the Python in a decode step.
        n = len(chunks)
        lens = np.fromiter((len(c.token_ids) for c in chunks), np.int32, n)
        past = np.fromiter((c.past_len for c in chunks), np.int32, n)
        first = np.fromiter((c.past_len if c.first_position is None else c.first_position for c in chunks),
                            np.int64, n)
        wanted = np.fromiter((c.num_logits for c in chunks), np.int64, n)
        begins = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=begins[1:])
        total = int(begins[-1])
        # token j of chunk i sits at row begins[i] + j with position first[i] + j
        positions = np.arange(total, dtype=np.int64) + np.repeat(first - begins[:-1], lens)
        # the last wanted[i] rows of chunk i, in chunk order
        num_sampled = int(wanted.sum())
        sampled = np.arange(num_sampled, dtype=np.int64) + np.repeat(begins[1:] - np.cumsum(wanted), wanted)
        inputs = {
            "input_ids": np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, total),
            "position_ids": positions,
            "past_lens": past,
            "subsequence_begins": begins,
            "max_context_len": np.array(int((past + lens).max()), dtype=np.int32),
            # The graph needs at least one row to gather; with none wanted, compute one and drop it.
            SAMPLED_INDICES: sampled if num_sampled else np.zeros(1, dtype=np.int64),
        }
        self._block_inputs(chunks, inputs)
        if self._has_rope_offsets:
            inputs[ROPE_OFFSETS] = self._rope_offsets(chunks, begins, positions)
        elif self._position_streams:
            inputs["position_ids"] = self._rope_streams(chunks, begins, positions)
        if self._has_scores:
            inputs["score_aggregation_window"] = np.array([c.score_window for c in chunks], dtype=np.int32)
        if self._has_rotation:
            self._rotation_inputs(rotation, inputs)
        # Tokens read in run on the main compilation whatever their number, so a prompt's last
        # tokens compute alike after a prefix-cache hit (a few on the decode model moved the first
        # token's logits by 0.6 on AMX) and in a prompt computed whole.
        use_decode = (self.fast_step_tokens is not None and total <= self.fast_step_tokens
                      and not any(c.prompt for c in chunks))
        if self._has_planes and not use_decode:
            inputs[lowbit.PLANES] = np.array(self.planes(chunks), dtype=np.int32)
        bound = (self._decode_inputs if use_decode else self._inputs)[self._turn]
        if self._image_width is not None and bound.takes_images:
            # image rows come with prompt chunks only, which run on the main compilation (above):
            # a decode step gives the inputs none
            self._image_inputs(chunks, begins, inputs, bound.takes_token_types)
        self._turn = (self._turn + 1) % len(self._inputs)
        inputs = bound.write(inputs)
        ids = inputs["input_ids"]
        return PreparedStep(bound.request, inputs, np.flatnonzero(ids < 0).tolist(), [c.num_logits for c in chunks])

    @staticmethod
    def _rope_offsets(chunks: Sequence[ScheduledChunk], begins: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """M-RoPE's [tokens, 2] height and width offsets from the temporal positions, which are set
        in `positions` (in place) for chunks holding image rows; 0 on every other token."""
        offsets = np.zeros((len(positions), 2), np.int64)
        for i, c in enumerate(chunks):
            if c.rope_positions is not None:
                rows = slice(begins[i], begins[i + 1])
                positions[rows] = c.rope_positions[0]
                offsets[rows] = (c.rope_positions[1:] - c.rope_positions[0]).T
        return offsets

    @staticmethod
    def _rope_streams(chunks: Sequence[ScheduledChunk], begins: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """M-RoPE's [3, tokens] temporal, height and width positions: the chunk's own where it
        holds image rows, else `positions` in all three (text, where the streams agree)."""
        streams = np.repeat(positions[None], 3, axis=0)
        for i, c in enumerate(chunks):
            if c.rope_positions is not None:
                streams[:, begins[i]:begins[i + 1]] = c.rope_positions
        return streams

    @staticmethod
    def planes(chunks: Sequence[ScheduledChunk]) -> int:
        """Int8 planes for the kernel's activations this step: two (near f32) where it computes
        prompt tokens, and where one sequence decodes, whose step reads the weights from memory
        and hides the second plane's products (Zen 5: 1.5B Q4_0 and the built-in model 0.99-1.01x
        the time; one plane there moved long-context perplexity 1-2% off f32's either way). Steps
        of several sequences decoding take one, llama.cpp's (4 and 16 sequences: 0.78x the time).
        In a step of two, some products take two on the sampled rows only (CompileOptions.lowbit_coarse)."""
        return 2 if len(chunks) == 1 or any(c.prompt for c in chunks) else 1

    def start(self, step: PreparedStep, fill: Sequence[int] = ()) -> None:
        """Starts the step, with `fill` (in order) for its placeholder tokens; returns at once."""
        ids = step.inputs["input_ids"]
        for row, token in zip(step.placeholders, fill, strict=True):  # scalar stores: a numpy call here costs ~8 us
            ids[row] = token
        begin = time.perf_counter()
        # Not infer(): it returns a copy of every output (the whole logits tensor); wait() reads it in place.
        step.request.start_async()
        self.infer_seconds += time.perf_counter() - begin

    def wait(self, step: PreparedStep) -> StepResult:
        begin = time.perf_counter()
        step.request.wait()
        self.infer_seconds += time.perf_counter() - begin
        # No copy: every use of the logits ends before this request runs again, and copying them was
        # a third of the runner's host time at 64 sequences (12.6 MB per step for a 49k vocabulary).
        num_rows = sum(step.num_logits)
        rows = step.request.get_tensor("logits").data.reshape(-1, self.model.facts.vocab_size)[:num_rows]
        scores = None
        if self._has_scores:
            scores = [np.array(step.request.get_tensor(f"scores.{i}").data) for i in range(self._num_layers)]
        return StepResult(rows, step.num_logits, scores)

    @staticmethod
    def _bind(compiled: ov.CompiledModel, cache: KVCache) -> _InputTensors:
        request = compiled.create_infer_request()
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            request.set_tensor(f"key_cache.{layer}", k)
            request.set_tensor(f"value_cache.{layer}", v)
        return _InputTensors(request)

    def _block_inputs(self, chunks: Sequence[ScheduledChunk], inputs: dict) -> None:
        counts = [len(c.block_tables[0]) for c in chunks]
        begins = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(counts, out=begins[1:])
        inputs["block_indices_begins"] = begins
        if not self._per_layer_tables:
            assert all(len(c.block_tables) == 1 for c in chunks), "several block tables need a model compiled with per-layer tables"
            inputs["block_indices"] = np.fromiter(itertools.chain.from_iterable(c.block_tables[0] for c in chunks),
                                                  np.int32, int(begins[-1]))
            return
        if all(len(c.block_tables) == 1 for c in chunks):
            shared = np.concatenate([np.asarray(c.block_tables[0], dtype=np.int32) for c in chunks])
            for layer in range(self._num_layers):
                inputs[f"block_indices.{layer}"] = shared
            return
        tables = [np.concatenate([np.asarray(c.block_tables[t if len(c.block_tables) > 1 else 0], dtype=np.int32)
                                  for c in chunks]) for t in range(self._num_tables)]
        for layer in range(self._num_layers):
            inputs[f"block_indices.{layer}"] = tables[self._table_of[layer]]

    def _image_inputs(self, chunks: Sequence[ScheduledChunk], begins: np.ndarray, inputs: dict,
                      token_types: bool) -> None:
        """The step's image rows and the rows of its flattened tokens they replace; none (M = 0:
        the plugin takes the empty tensors, and the scatter then leaves the embeddings as they are)
        in a step without images. `token_types`: the graph also takes which rows are an image's
        (model/image_attention.py): 1 on those, the empty input (causal) in a step without any.
        A chunk holds its images whole there (the scheduler keeps them so), so each run of 1s is
        exactly one image."""
        rows = [np.arange(n, dtype=np.int64) + (begins[i] + at)
                for i, c in enumerate(chunks) for at, r in c.images for n in (len(r),)]
        if rows:
            inputs[IMAGE_ROWS] = np.concatenate(rows)
            inputs[IMAGE_EMBEDS] = np.concatenate([r for c in chunks for _, r in c.images])
        else:
            inputs[IMAGE_ROWS], inputs[IMAGE_EMBEDS] = self._no_images
        if token_types:
            types = np.zeros(int(begins[-1]) if rows else 0, np.int32)
            types[inputs[IMAGE_ROWS]] = 1
            inputs[TOKEN_TYPES] = types

    def _rotation_inputs(self, rotation: KernelRotation | None, inputs: dict) -> None:
        head_size = self.model.facts.head_size
        inputs["model_rotation_trig_lut"] = (rotation.table if rotation is not None
                                             else np.zeros((1, head_size), dtype=np.float32))
        for layer in range(self._num_layers):
            if rotation is None:
                blocks, deltas = np.zeros(0, np.int32), np.zeros((0, 1), np.int32)
            else:
                blocks, deltas = rotation.blocks[layer], rotation.deltas[layer]
            inputs[f"rotated_block_indices.{layer}"] = blocks
            inputs[f"rotation_deltas.{layer}"] = deltas
