"""Read a Llama-family GGUF file: architecture facts and dequantized weights, as numpy."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.rope import RopeConfig

# llama.cpp stores Q/K rows of these architectures interleaved for its GPT-J style RoPE.
_PERMUTED_QK = ("llama", "mistral")


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass
class GGUFModel:
    """A GGUF file opened for conversion: config from metadata, weights on demand."""

    path: Path
    reader: gguf.GGUFReader
    tensors: dict[str, gguf.ReaderTensor]
    config: ModelConfig

    @classmethod
    def open(cls, path: Path) -> GGUFModel:
        reader = open_gguf(path)
        tensors = {t.name: t for t in reader.tensors}
        return cls(path, reader, tensors, _read_config(reader, tensors))

    def tensor(self, name: str) -> GGUFTensor:
        """Tensor `name` as the file holds it, rows in HF order ([out, in] for matrices)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data.reshape(-1)
        cfg = self.config
        if cfg.architecture in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            data = _unpermute_rows(data, heads)  # rows are whole blocks: the same for every type
        return GGUFTensor(name, t.tensor_type, data, shape, self.path)

    def weight(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in HF layout ([out, in] for matrices)."""
        return self.tensor(name).dequantize()

    def has(self, name: str) -> bool:
        return name in self.tensors


@dataclass(frozen=True)
class GGUFTensor:
    """A weight as the file holds it. Quantized types keep their blocks: `data` is uint8
    [rows, bytes per row]; float types are [rows, cols] (1-D tensors: [n]). Rows are in HF's
    order, so taking rows and dequantizing commute."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]  # HF layout: [out, in] for matrices
    path: Path | None = None  # for error messages

    @classmethod
    def from_array(cls, name: str, a: np.ndarray) -> GGUFTensor:
        a = np.ascontiguousarray(a, dtype=np.float32)
        return cls(name, gguf.GGMLQuantizationType.F32, a, a.shape)

    def dequantize(self) -> np.ndarray:
        """float32 values in `shape`."""
        try:
            w = gguf.quants.dequantize(self.data, self.ggml_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {self.name} is {self.ggml_type.name}, which vinoserve cannot "
                                 f"read; supported: {', '.join(readable_types())}") from e
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: cannot dequantize {self.name} ({self.ggml_type.name}): {e}") from e
        return w.reshape(self.shape)


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The tensor types gguf-py dequantizes, found by asking it for one block of each."""
    names = []
    for t in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[t]
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), t)
        except (NotImplementedError, ValueError):
            continue
        names.append(t.name)
    return tuple(names)


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute`: back to HF's rotate-half row order."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _read_config(reader: gguf.GGUFReader, tensors: dict) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str, default=None):
        return field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_size = int(key("attention.key_length", hidden // heads))
    kv_heads = key("attention.head_count_kv", heads)
    vocab = key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_freqs = tensors.get("rope_freqs.weight")
    rope = RopeConfig(
        theta=float(key("rope.freq_base", 10000.0)),
        dim=int(key("rope.dimension_count", head_size)),
        scaling=_rope_scaling(key),
        freq_factors=tuple(float(x) for x in np.asarray(rope_freqs.data, np.float32)) if rope_freqs else None,
    )
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture=arch,
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_size=head_size,
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        max_context=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _rope_scaling(key) -> dict | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = key("rope.scaling.factor")
    scaling = {"rope_type": kind, "factor": float(factor) if factor is not None else 1.0}
    orig = key("rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling
