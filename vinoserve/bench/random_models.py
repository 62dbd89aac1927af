"""Llama-shaped GGUFs with random weights at the sizes users serve, for speed and memory figures.

The 135M built-in model fits in cache and hides what bytes per weight cost; these do not. Names
`llama-<shape>-<type>-random` (e.g. `llama-1.5b-q4_0-random`) are accepted as `--model` by
`vinoserve bench engine` and `vinoserve bench llamacpp`; the file is written once into the cache's
bench/ directory. Shapes follow public configs; the vocabulary and tokenizer are SmolLM2's (from
the built-in GGUF), so prompts are real text. Weights ~N(0, 0.02), norms 1: the text is noise,
the timing is real. Tensors are written one at a time (an 8B file never sits in memory).

    python -m vinoserve.bench.random_models llama-8b-q4_0-random     # write it, print its path
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model import default_model
from vinoserve.model.storage import cache_root

SHAPES = {  # hidden, layers, heads, kv heads, intermediate
    "0.5b": (896, 24, 14, 2, 4864),  # Qwen2.5-0.5B
    "1.5b": (1536, 28, 12, 2, 8960),  # Qwen2.5-1.5B
    "3b": (3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "8b": (4096, 32, 32, 8, 14336),  # Llama-3.1-8B
}
# what gguf-py can quantize, and llama.cpp's commonest mix (our K-quant writer, kquants.py)
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "q4_k_m")
_NAME = re.compile(r"llama-(?P<shape>[\d.]+b)-(?P<type>\w+?)-random")

# (tensor name, float32 values) -> (raw data, ggml type): how each matrix is stored
Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]


def names() -> list[str]:
    return [f"llama-{s}-{t}-random" for s in SHAPES for t in TYPES]


def one_type(qtype: gguf.GGMLQuantizationType) -> Encoder:
    """Every matrix in `qtype` (gguf-py's quantizer)."""
    if qtype == gguf.GGMLQuantizationType.F16:
        return lambda name, x: (x.astype(np.float16), qtype)
    return lambda name, x: (gguf.quants.quantize(x, qtype), qtype)


def resolve(model: str) -> str:
    """`model` itself, or for a random model's name the path of its GGUF (written if missing)."""
    m = _NAME.fullmatch(model)
    if not m or m["shape"] not in SHAPES or m["type"] not in TYPES:
        return model
    path = cache_root() / "bench" / f"{model}.gguf"
    if not path.is_file():
        shape, qtype = m["shape"], m["type"]
        encode = q4_k_m(SHAPES[shape][1]) if qtype == "q4_k_m" else one_type(gguf.GGMLQuantizationType[qtype.upper()])
        write(path, shape, encode)
    return str(path)


def q4_k_m(layers: int) -> Encoder:
    """llama-quantize's Q4_K_M choice (llama_tensor_get_type): Q4_K throughout, Q6_K for the LM
    head and for attn_v and ffn_down in the first and last eighth of the layers and every third
    one between them (`use_more_bits`)."""
    from vinoserve.bench import kquants

    T = gguf.GGMLQuantizationType

    def more_bits(layer: int) -> bool:
        return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2

    def encode(name: str, x: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        qtype = T.Q4_K
        if name == "output.weight":
            qtype = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(int(name.split(".")[1])):
            qtype = T.Q6_K
        return kquants.quantize(x, qtype), qtype
    return encode


def write(path: Path, shape: str, encode: Encoder, log=print) -> Path:
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    head = hidden // heads
    tokenizer = gguf.GGUFReader(default_model.fetch(default_model.DEFAULT_MODEL, log=lambda m: None))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), "llama", use_temp_file=True)  # tensors spill to disk, not memory
    _copy_tokenizer(tokenizer, w)
    w.add_name(path.stem)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)

    def mat(name: str, rows: int, cols: int) -> None:
        raw, qtype = encode(name, rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        w.add_tensor(name, raw, raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F16,) else qtype)

    log(f"writing {path.name} ({shape}: {layers} layers, hidden {hidden}) ...")
    mat("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    mat("output.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in [("attn_q", heads * head, hidden), ("attn_k", kv_heads * head, hidden),
                                 ("attn_v", kv_heads * head, hidden), ("attn_output", hidden, heads * head),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)]:
            mat(f"{p}{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.rename(path)
    return path


def _copy_tokenizer(src: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    for name, f in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind, value = f.types[0], f.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(name, value)
        elif kind in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32):
            w.add_uint32(name, int(value))
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(name, bool(value))


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["--help"]:
        if arg not in names():
            raise SystemExit(f"random models: {', '.join(names())}")
        print(resolve(arg))
